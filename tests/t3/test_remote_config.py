"""RemoteConfig, the daemon config's [remote] section and the store's config in one: the file's
endpoint text is parsed, no endpoints is no T3, the password comes from password_file (a mounted
Secret, its trailing newline dropped) or password, a file that cannot be read is InvalidArgument
naming the file, and the password is never in a repr nor in the start-up lines."""

from __future__ import annotations

import pytest

from kvtierd.errors import InvalidArgument
from kvtierd.server.config_loader import load_config
from kvtierd.server.config_summary import config_lines
from kvtierd.t3.remote_config import RemoteConfig, format_endpoints

SECRET = "s3cret-0f9e-never-logged"


def test_no_endpoints_is_no_t3():
    assert not RemoteConfig().enabled and not RemoteConfig(endpoints="").enabled
    assert not load_config(environ={}).remote.enabled
    assert "T3 shared store: off" in config_lines(load_config(environ={}))


def test_the_files_endpoint_text_is_parsed_and_printed_back():
    """The file's "host:port,[v6]:port" becomes (host, port) seeds, and reads back the same."""
    config = load_config(environ={}, overrides={"remote.endpoints": "10.0.0.1:7000, [::1]:7001"}).remote
    assert config.endpoints == (("10.0.0.1", 7000), ("::1", 7001)) and config.enabled
    assert format_endpoints(config.endpoints) == "10.0.0.1:7000,[::1]:7001"
    assert RemoteConfig(endpoints=format_endpoints(config.endpoints)).endpoints == config.endpoints


@pytest.mark.parametrize("endpoints, fragment", [
    (" , ", "remote.endpoints must name at least one host:port"),
    ("redis-0", "remote.endpoints: 'redis-0' is not host:port"),
    ("redis-0:70000", "is not host:port"),
])
def test_bad_endpoints_are_refused_at_load(endpoints, fragment):
    with pytest.raises(InvalidArgument, match=fragment):
        load_config(environ={}, overrides={"remote.endpoints": endpoints})


@pytest.mark.parametrize("overrides, fragment", [
    ({"remote.mode": "sentinel"}, "remote.mode must be one of auto, cluster, single; got 'sentinel'"),
    ({"remote.codec": "zstd"}, "remote.codec must be one of raw, fp8; got 'zstd'"),
    ({"remote.timeout_s": 0}, "remote.timeout_s, remote.breaker_open_s and remote.probe_interval_s must be > 0"),
    ({"remote.breaker_failures": 0}, "remote.breaker_failures >= 1"),
    ({"remote.ttl_s": -1}, "remote.ttl_s and remote.max_write_backlog_bytes must be >= 0"),
    ({"remote.tls_cert_file": "/c"}, "remote.tls_cert_file and remote.tls_key_file go together"),
    ({"remote.key_prefix": "a:b"}, "remote.key_prefix must be non-empty"),
])
def test_each_remote_rule_rejects_with_a_clear_message(overrides, fragment):
    with pytest.raises(InvalidArgument, match=fragment):
        load_config(environ={}, overrides={"remote.endpoints": "127.0.0.1:6379", **overrides})


@pytest.mark.parametrize("content, password", [
    (SECRET + "\n", SECRET),
    (SECRET + "\r\n", SECRET),
    (SECRET, SECRET),
    (" pass word \n", " pass word "),  # only the line end goes
])
def test_the_password_file_gives_the_password_without_its_line_end(tmp_path, content, password):
    path = tmp_path / "password"
    path.write_text(content, newline="")
    config = RemoteConfig(endpoints="127.0.0.1:6379", password_file=str(path)).with_password_read()
    assert config.password == password and config.password_file == ""


def test_without_a_password_file_the_config_is_used_as_it_is():
    config = RemoteConfig(endpoints="127.0.0.1:6379", password=SECRET)
    assert config.with_password_read() is config


@pytest.mark.parametrize("make", [
    pytest.param(lambda tmp_path: tmp_path / "absent", id="missing"),
    pytest.param(lambda tmp_path: tmp_path, id="a-directory"),
])
def test_a_password_file_that_cannot_be_read_is_invalid_argument_naming_it(tmp_path, make):
    path = make(tmp_path)
    with pytest.raises(InvalidArgument, match="remote.password_file") as refused:
        RemoteConfig(endpoints="127.0.0.1:6379", password_file=str(path)).with_password_read()
    assert str(path) in str(refused.value)


def test_the_password_is_in_no_repr(tmp_path):
    """repr of the section, the store's config (password read) and the whole daemon config never shows it."""
    (tmp_path / "password").write_text(SECRET + "\n")
    section = RemoteConfig(endpoints="127.0.0.1:6379", username="kv", password=SECRET)
    read = RemoteConfig(endpoints="127.0.0.1:6379", password_file=str(tmp_path / "password")).with_password_read()
    assert read.password == SECRET  # it is there, only not shown
    daemon = load_config(environ={}, overrides={"remote.endpoints": "127.0.0.1:6379", "remote.password": SECRET})
    for shown in (repr(section), repr(read), str(read), repr(daemon)):
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


@pytest.mark.parametrize("ttl_s, max_age_s, expected_ms", [(0, 0.0, 0), (60, 0.0, 60_000), (0, 2.5, 2_500),
                                                           (60, 2.5, 2_500), (2, 30.0, 2_000), (0, 0.0001, 1)])
def test_a_value_expires_after_the_smaller_of_remote_ttl_s_and_retention_max_age_s(ttl_s, max_age_s, expected_ms):
    """value_ttl_ms: the store's expiry of a value (SET PX); 0 = none; never rounded down to none."""
    assert RemoteConfig(ttl_s=ttl_s).value_ttl_ms(max_age_s) == expected_ms
