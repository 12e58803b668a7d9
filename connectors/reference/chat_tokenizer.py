"""A model's tokenizer and chat template, for prompts written as chat messages.

transformers builds the tokenizer (a byte-level BPE from `tokenizer.ggml.tokens` / `merges`)
and reads the chat template (`tokenizer.chat_template`) from a GGUF file's metadata; that
conversion takes seconds, so the result is saved once beside the GGUF file
(`<name>.tokenizer/`, tokenizer.json and the template) and loaded from there afterwards. A
Hugging Face model directory with its own tokenizer files loads as it is.
"""

from __future__ import annotations

from pathlib import Path

from kvtierd.errors import InvalidArgument


def _auto_tokenizer():
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise InvalidArgument("the chat tokenizer needs transformers: pip install 'kvtierd[demo]'") from e
    return AutoTokenizer


class ChatTokenizer:
    """Messages ({"role", "content"}) to prompt token ids through the model's chat template."""

    def __init__(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidArgument("the model's tokenizer has no chat template")
        self._tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id

    @classmethod
    def from_gguf(cls, gguf_path: str | Path) -> ChatTokenizer:
        gguf_path = Path(gguf_path)
        saved = gguf_path.with_name(gguf_path.name + ".tokenizer")
        auto = _auto_tokenizer()
        if (saved / "tokenizer.json").is_file():
            return cls(auto.from_pretrained(str(saved)))
        tokenizer = auto.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        try:
            tokenizer.save_pretrained(str(saved))
        except OSError:
            pass  # a read-only model directory: convert again next time
        return cls(tokenizer)

    @classmethod
    def from_directory(cls, directory: str | Path) -> ChatTokenizer:
        try:
            return cls(_auto_tokenizer().from_pretrained(str(directory)))
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"{directory} has no tokenizer that transformers can load: {e}") from e

    def save(self, directory: str | Path) -> None:
        """The tokenizer files and chat template, as a Hugging Face directory holds them."""
        self._tokenizer.save_pretrained(str(directory))

    def prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of `messages` rendered by the chat template, ending with the assistant's turn."""
        text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self._tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        """The reply's text, without the end-of-turn token."""
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)
