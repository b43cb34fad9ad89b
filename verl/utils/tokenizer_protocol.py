"""`Tokenizer`: what verl uses of a Hugging Face tokenizer, as one `typing.Protocol` for annotations.

A `transformers` tokenizer (`PreTrainedTokenizerBase`) satisfies it; so does any object with these members.
Only the members verl calls or reads are declared; a few optional ones are read with `getattr(..., default)`
and are therefore not part of the protocol (`added_tokens_decoder`, `all_special_tokens`, `generation_config`).
It is an annotation, not a runtime check: nothing calls `isinstance` on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class Tokenizer(Protocol):
    """The tokenizer members verl uses (a Hugging Face tokenizer has them all)."""

    pad_token: str | None
    pad_token_id: int | None
    eos_token: str | None
    eos_token_id: int | None
    bos_token: str | None
    bos_token_id: int | None
    unk_token: str | None
    unk_token_id: int | None
    chat_template: str | dict[str, str] | None  # a dict: named templates (older tokenizers)

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        """Encode text (or a list of texts): a `BatchEncoding` with `input_ids` (and the mask, offsets, ...)."""
        ...

    def __len__(self) -> int:
        """The vocabulary size, added tokens included."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...

    def batch_decode(self, sequences: Sequence[Sequence[int]], *, skip_special_tokens: bool = ...) -> list[str]: ...

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], **kwargs: Any) -> Any:
        """The rendered conversation: text with `tokenize=False`, token ids otherwise."""
        ...

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]: ...

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]: ...

    def get_vocab(self) -> dict[str, int]: ...


__all__ = ["Tokenizer"]
