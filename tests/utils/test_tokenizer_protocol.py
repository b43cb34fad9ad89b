"""`verl.utils.tokenizer_protocol.Tokenizer` describes a real Hugging Face tokenizer: the tiny model's has
every member the protocol declares."""

from __future__ import annotations

import inspect

from verl.utils.tokenizer_protocol import Tokenizer


def protocol_members(protocol: type) -> set[str]:
    """The attributes (annotations) and methods (functions of the class body) a protocol declares."""
    methods = {name for name, value in vars(protocol).items()
               if inspect.isfunction(value) and name not in dir(object)}  # not the hooks Protocol adds
    return set(protocol.__annotations__) | methods


def test_the_protocol_declares_what_verl_uses():
    members = protocol_members(Tokenizer)
    assert {"__call__", "__len__", "encode", "decode", "apply_chat_template", "convert_tokens_to_ids",
            "convert_ids_to_tokens", "get_vocab", "pad_token_id", "eos_token_id", "eos_token",
            "chat_template"} <= members, members


def test_the_tiny_tokenizer_has_every_member(tiny_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    missing = sorted(m for m in protocol_members(Tokenizer) if not hasattr(tokenizer, m))
    assert not missing, f"{type(tokenizer).__name__} lacks {missing}"
    assert len(tokenizer) > 0 and isinstance(tokenizer.decode(tokenizer.encode("1+1", add_special_tokens=False)), str)
