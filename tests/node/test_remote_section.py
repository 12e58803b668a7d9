"""The daemon config's [remote] section: the password comes from password_file (a mounted Secret, its
trailing newline dropped) or password, a file that cannot be read is InvalidArgument naming the file,
and the password is never in a repr nor in the start-up lines."""

from __future__ import annotations

import dataclasses

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.node.config_summary import config_lines
from kvtierd.node.daemon_config import load_config
from kvtierd.node.remote_section import RemoteSection, remote_config_of
from kvtierd.t3.remote_config import RemoteConfig

SECRET = "s3cret-0f9e-never-logged"


def test_no_endpoints_is_no_t3():
    assert remote_config_of(RemoteSection()) is None
    assert remote_config_of(RemoteSection(password=SECRET)) is None


def test_every_field_reaches_the_store_config():
    """Each [remote] setting (but the password's source) lands in the RemoteConfig under its own name."""
    section = RemoteSection(endpoints="10.0.0.1:7000, [::1]:7001", mode="cluster", username="kv", password=SECRET,
                            tls=True, tls_ca_file="/ca", tls_cert_file="/c", tls_key_file="/k", key_prefix="p",
                            codec="fp8", timeout_s=0.2, max_write_backlog_bytes=123, breaker_failures=4,
                            breaker_open_s=2.5, ttl_s=60)
    config = remote_config_of(section)
    assert config.endpoints == (("10.0.0.1", 7000), ("::1", 7001))
    assert config.password == SECRET
    for field in dataclasses.fields(RemoteConfig):
        if field.name not in ("endpoints", "password"):
            assert getattr(config, field.name) == getattr(section, field.name), field.name


@pytest.mark.parametrize("content, password", [
    (SECRET + "\n", SECRET),
    (SECRET + "\r\n", SECRET),
    (SECRET, SECRET),
    (" pass word \n", " pass word "),  # only the line end goes
])
def test_the_password_file_gives_the_password_without_its_line_end(tmp_path, content, password):
    path = tmp_path / "password"
    path.write_text(content, newline="")
    config = remote_config_of(RemoteSection(endpoints="127.0.0.1:6379", password_file=str(path)))
    assert config.password == password


@pytest.mark.parametrize("make", [
    pytest.param(lambda tmp_path: tmp_path / "absent", id="missing"),
    pytest.param(lambda tmp_path: tmp_path, id="a-directory"),
])
def test_a_password_file_that_cannot_be_read_is_invalid_argument_naming_it(tmp_path, make):
    path = make(tmp_path)
    with pytest.raises(InvalidArgument, match="remote.password_file") as refused:
        remote_config_of(RemoteSection(endpoints="127.0.0.1:6379", password_file=str(path)))
    assert str(path) in str(refused.value)


def test_the_password_is_in_no_repr():
    """repr of the section, the store config and the whole daemon config never shows the password."""
    section = RemoteSection(endpoints="127.0.0.1:6379", username="kv", password=SECRET)
    config = remote_config_of(section)
    assert config.password == SECRET  # it is there, only not shown
    daemon = load_config(environ={}, overrides={"remote.endpoints": "127.0.0.1:6379", "remote.password": SECRET})
    for shown in (repr(section), repr(config), str(config), repr(daemon)):
        assert SECRET not in shown
    assert "kv" in repr(section)  # the rest is shown


def test_the_startup_lines_never_show_the_password(tmp_path):
    """config_lines with a password, or a password file: the T3 line is there, the password is not."""
    (tmp_path / "password").write_text(SECRET + "\n")
    for remote in ({"remote.password": SECRET}, {"remote.password_file": str(tmp_path / "password")}):
        daemon = load_config(environ={}, overrides={"remote.endpoints": "127.0.0.1:6379", **remote})
        lines = "\n".join(config_lines(daemon))
        assert "T3 shared store: 127.0.0.1:6379" in lines
        assert SECRET not in lines
    assert "password from " + str(tmp_path / "password") in lines


def test_password_and_password_file_together_are_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="set one of them"):
        load_config(environ={}, overrides={"remote.endpoints": "127.0.0.1:6379", "remote.password": SECRET,
                                           "remote.password_file": str(tmp_path / "p")})
