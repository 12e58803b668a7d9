"""`kvtierd demo`'s flags: one that the chosen model ignores is refused with one line
naming it (exit 2 through kvtierd_main), not silently dropped; with the model it shapes, it applies."""

from __future__ import annotations

import argparse

import pytest

from kvtierd.connectors.demo.demo_cli import add_demo_flags, demo_options
from kvtierd.errors import InvalidArgument


def parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtierd demo")
    add_demo_flags(parser)
    return parser.parse_args(args)


@pytest.mark.parametrize("flag, value, applied", [
    ("--layers", "3", lambda options: options.random_model.num_hidden_layers),
    ("--hidden", "128", lambda options: options.random_model.hidden_size),
    ("--system-prompt-tokens", "64", lambda options: options.workload.system_prompt_tokens),
    ("--first-turn-tokens", "32", lambda options: options.workload.first_turn_tokens),
    ("--seed", "7", lambda options: options.seed),
])
def test_a_random_model_flag_needs_random_weights(flag, value, applied):
    """Without --random-weights the flag is refused by name; with it, its value is what the demo runs."""
    with pytest.raises(InvalidArgument) as refused:
        demo_options(parse(flag, value))
    assert str(refused.value) == f"{flag} applies only with --random-weights"
    assert applied(demo_options(parse("--random-weights", flag, value))) == int(value)


def test_random_weights_without_its_flags_keeps_the_random_models_defaults():
    """The flags default to None only to tell "given" apart: unset, the random model is the usual one."""
    from kvtierd.connectors.demo.demo import RANDOM_MODEL
    from kvtierd.connectors.demo.demo_workload import DemoWorkload

    options = demo_options(parse("--random-weights"))
    defaults = DemoWorkload()
    assert (options.random_model.num_hidden_layers, options.random_model.hidden_size) == (
        RANDOM_MODEL.num_hidden_layers, RANDOM_MODEL.hidden_size)
    assert (options.workload.system_prompt_tokens, options.workload.first_turn_tokens, options.seed) == (
        defaults.system_prompt_tokens, defaults.first_turn_tokens, 0)
    with pytest.raises(InvalidArgument, match="^--layers, --seed apply only with --random-weights$"):
        demo_options(parse("--layers", "2", "--seed", "1"))


@pytest.mark.parametrize("args, line", [
    (("--random-weights", "--model-cache", "/tmp/m"),
     "--model-cache applies only to SmolLM2 (not with --random-weights)"),
    (("--model", "/tmp/m.gguf", "--model-cache", "/tmp/m"), "--model-cache applies only to SmolLM2 (not with --model)"),
], ids=["with-random-weights", "with-model"])
def test_model_cache_with_another_model_is_refused(args, line):
    """--model-cache is where SmolLM2 is fetched to: with another model it would be ignored."""
    with pytest.raises(InvalidArgument) as refused:
        demo_options(parse(*args))
    assert str(refused.value) == line
