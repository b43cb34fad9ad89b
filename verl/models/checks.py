"""Model/tokenizer consistency checks, shared by `load_hf_model`, the trainer's start-up and `verl check`.

Each check here guards against a failure that otherwise trains "fine" and produces garbage: a chat template
whose special tokens the tokenizer cannot encode (the prompt silently becomes several junk ids), ids beyond
the embedding matrix, a pad token of None, or a tokenizer eos that the model never emits. The checks collect
problems into a `LoadReport` instead of raising at the first one, so `verl check` can show all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from verl.errors import ModelError
from verl.utils.tokenizer_protocol import Tokenizer

# Special-token markers chat templates emit: ChatML/Llama-3 style "<|...|>", sentencepiece "<s>"/"</s>",
# Gemma's turn markers. Plain-text markers such as Llama-2's "[INST]" are ordinary text and not checked.
_MARKER_RE = re.compile(r"<\|[^<>\s|]+\|>|</?s>|<(?:start|end)_of_turn>|<(?:bos|eos|pad)>")

PROBE_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 12+7?"},
    {"role": "assistant", "content": "The answer is 19."},
]

# Texts whose ids must agree between a substitute tokenizer and the model's own one.
PROBE_TEXTS = [
    "What is 12+7? The answer is 19.",
    "Hello world, this is a test of the tokenizer.",
    "  spaces\nand newlines\t\ttabs",
    "Unicode: café — 東京",
]


@dataclass
class SpecialToken:
    """One row of the special-token table: role (bos/eos/pad/unk/stop), token text, id and a note."""

    role: str
    token: str | None
    id: int | None
    note: str = ""


@dataclass
class LoadReport:
    """What was loaded and what is wrong with it; `verl check` prints it, `load_hf_model` raises on problems."""

    model_source: str
    tokenizer_source: str
    revision: str | None = None
    model_type: str = ""
    architecture: str = ""
    dtype: str = ""
    attn_implementation: str = ""
    device: str = ""
    num_parameters: int = 0
    num_trainable_parameters: int = 0
    embedding_rows: int = 0
    tokenizer_size: int = 0
    special_tokens: list[SpecialToken] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    chat_template: str = "not checked"
    trust_remote_code: bool = False
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # A vision-language model's processor (tokenizer + image processor + chat template) and its one-line
    # summary; None and "" for a text model (`verl.models.vision_checks`).
    processor: Any = field(default=None, repr=False, compare=False)
    vision: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_problems(self) -> None:
        """Raise one ModelError listing every problem (each already says what, where and the fix)."""
        if self.problems:
            header = (f"model {self.model_source!r} with tokenizer {self.tokenizer_source!r} failed "
                      f"{len(self.problems)} load-time check(s):")
            raise ModelError("\n".join([header] + [f"  - {p}" for p in self.problems]))

    def summary_rows(self) -> list[tuple[str, str]]:
        """(field, value) pairs for a two-column table."""
        rows = [
            ("model", self.model_source + (f" @ {self.revision}" if self.revision else "")),
            ("tokenizer", self.tokenizer_source),
            ("architecture", f"{self.architecture} ({self.model_type})"),
            ("dtype", self.dtype),
            ("attention", self.attn_implementation),
            ("device", self.device),
            ("parameters", f"{self.num_parameters:,} ({self.num_trainable_parameters:,} trainable)"),
            ("embedding rows / tokenizer size", f"{self.embedding_rows} / {self.tokenizer_size}"),
            ("stop token ids", ", ".join(map(str, self.stop_token_ids)) or "none"),
            ("chat template", self.chat_template),
            ("trust_remote_code", str(self.trust_remote_code)),
        ]
        if self.vision:
            rows.append(("vision", self.vision))
        return rows

    def format(self) -> str:
        """Plain-text rendering for logs (the CLI renders the same data as rich tables)."""
        width = max(len(k) for k, _ in self.summary_rows())
        lines = [f"{k.ljust(width)}  {v}" for k, v in self.summary_rows()]
        lines.append("special tokens:")
        for t in self.special_tokens:
            lines.append(f"  {t.role:<5} {t.token!s:<20} {t.id!s:<8} {t.note}")
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)


def embedding_rows(model: Any) -> int:
    """Rows of the input embedding (and of an untied output head, whichever is smaller)."""
    rows = model.get_input_embeddings().weight.shape[0]
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None and getattr(out, "weight", None) is not None:
        rows = min(rows, out.weight.shape[0])
    return int(rows)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _token_id(tokenizer: Tokenizer, token: str) -> int | None:
    """The single id of ``token`` or None when the tokenizer does not have it as one token."""
    vocab_id = tokenizer.convert_tokens_to_ids(token)
    if vocab_id is None:
        return None
    if tokenizer.unk_token_id is not None and vocab_id == tokenizer.unk_token_id and token != tokenizer.unk_token:
        return None
    ids = tokenizer.encode(token, add_special_tokens=False)
    return vocab_id if ids == [vocab_id] else None


def _template_text(tokenizer: Tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


def render_probe(tokenizer: Tokenizer, *, template: str | None = None) -> str:
    """Render the probe conversation (falling back to no system turn for templates that reject one)."""
    kwargs: dict[str, Any] = {"tokenize": False}
    if template is not None:
        kwargs["chat_template"] = template
    try:
        return tokenizer.apply_chat_template(PROBE_CONVERSATION, **kwargs)
    except Exception:  # noqa: BLE001 - some templates raise for a system turn; retry without it
        return tokenizer.apply_chat_template(PROBE_CONVERSATION[1:], **kwargs)


def check_model_and_tokenizer(
    model: Any,
    tokenizer: Tokenizer,
    *,
    chat: bool | None = None,
    model_source: str = "<model>",
    tokenizer_source: str | None = None,
    reference_tokenizer: Tokenizer | None = None,
    pad_token: str | None = None,
    eos_token: str | None = None,
    fix: bool = True,
    tokenizer_key: str = "tokenizer_name",
) -> LoadReport:
    """Check that ``tokenizer`` fits ``model`` and return a report with every problem found.

    ``chat``: True when prompts will be chat-formatted (a template is required), False to skip template
    checks, None to check a template only if present. ``reference_tokenizer`` is the model's own tokenizer
    when a different one was supplied: its text ids and chat-template tokens must carry over. With ``fix``,
    a missing pad token is set (to ``pad_token`` or eos) and the tokenizer/generation eos are reconciled on
    the objects, so that training and rollout use the same ids this report shows. ``tokenizer_key`` is how
    the caller names the tokenizer option in fixes (`model.tokenizer_path` for a config).
    """
    tok_src = tokenizer_source or model_source
    both = f"(model {model_source}, tokenizer {tok_src})" if tok_src != model_source else f"({model_source})"
    report = LoadReport(model_source=model_source, tokenizer_source=tok_src)
    rows = embedding_rows(model)
    report.embedding_rows = rows
    report.tokenizer_size = len(tokenizer)
    config = model.config
    report.model_type = str(getattr(config, "model_type", ""))
    report.architecture = ",".join(getattr(config, "architectures", None) or [type(model).__name__])

    _check_vocab_size(report, tokenizer, rows, both, tokenizer_key)
    if reference_tokenizer is not None and tok_src != model_source:
        _check_same_text_ids(report, tokenizer, reference_tokenizer, model_source, tok_src, tokenizer_key)
    _resolve_eos(report, model, tokenizer, rows, both, eos_token=eos_token, fix=fix)
    _resolve_pad(report, model, tokenizer, rows, both, pad_token=pad_token, fix=fix)
    _resolve_bos_unk(report, tokenizer, rows, both)
    if chat is not False:
        _check_chat_template(report, tokenizer, reference_tokenizer, rows, chat=chat, model_source=model_source,
                             tok_src=tok_src, both=both, tokenizer_key=tokenizer_key)
    else:
        report.chat_template = "not checked (chat formatting off)"
    return report


def _check_vocab_size(report: LoadReport, tokenizer: Tokenizer, rows: int, both: str, tokenizer_key: str) -> None:
    if len(tokenizer) <= rows:
        return
    beyond = sorted(
        (int(i), str(t)) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if int(i) >= rows
    )
    shown = ", ".join(f"{t!r}={i}" for i, t in beyond[:6]) or f"ids {rows}..{len(tokenizer) - 1}"
    report.problems.append(
        f"the tokenizer has {len(tokenizer)} tokens but the model's embedding matrix has only {rows} rows "
        f"{both}; ids >= {rows} ({shown}) would index past the embedding (an IndexError on CPU, a device-side "
        f"assert on GPU). Fix: use the tokenizer that ships with the model (drop {tokenizer_key}), or, if you "
        "added tokens on purpose, call model.resize_token_embeddings(len(tokenizer)) before training.")


def _check_same_text_ids(report: LoadReport, tokenizer: Tokenizer, reference: Tokenizer, model_source: str,
                         tok_src: str, tokenizer_key: str) -> None:
    for text in PROBE_TEXTS:
        ours = tokenizer.encode(text, add_special_tokens=False)
        theirs = reference.encode(text, add_special_tokens=False)
        if ours != theirs:
            report.problems.append(
                f"tokenizer {tok_src} encodes {text!r} as {ours[:12]} but the model's own tokenizer at "
                f"{model_source} gives {theirs[:12]}: the vocabularies differ, so every embedding lookup would "
                f"use the wrong row. Fix: drop {tokenizer_key} to use {model_source}'s tokenizer, or choose a "
                "tokenizer with the same vocabulary.")
            return


def _resolve_eos(report: LoadReport, model: Any, tokenizer: Tokenizer, rows: int, both: str, *,
                 eos_token: str | None, fix: bool) -> None:
    if eos_token is not None:
        if _token_id(tokenizer, eos_token) is None:
            report.problems.append(f"eos_token={eos_token!r} is not a single token of the tokenizer {both}. Fix: "
                                   "pass a token the tokenizer has (see its special tokens) or leave it unset.")
            return
        if fix:
            tokenizer.eos_token = eos_token
    tok_eos = tokenizer.eos_token_id
    gen_config = getattr(model, "generation_config", None)
    gen_eos = _as_id_list(getattr(gen_config, "eos_token_id", None)) or _as_id_list(
        getattr(model.config, "eos_token_id", None))
    for i in gen_eos:
        if i >= rows:
            report.problems.append(f"generation_config.eos_token_id {i} is >= the {rows} embedding rows {both}. "
                                   "Fix: correct eos_token_id in generation_config.json/config.json.")
    if tok_eos is None and not gen_eos:
        report.problems.append(
            f"neither the tokenizer nor the generation config defines an eos token {both}, so generation would "
            "never stop. Fix: pass eos_token='<the end-of-turn token>' or use the model's own tokenizer.")
        stop: list[int] = []
    elif tok_eos is None:
        stop = gen_eos
        report.warnings.append(f"the tokenizer has no eos token; stopping on generation_config eos {gen_eos}.")
    elif not gen_eos or tok_eos in gen_eos:
        stop = [tok_eos] + [i for i in gen_eos if i != tok_eos]
    elif eos_token is not None:
        stop = [tok_eos] + gen_eos
        report.warnings.append(f"eos_token={eos_token!r} overrides the generation config's eos {gen_eos}; "
                               f"generation stops on any of {stop}.")
    else:
        names = [tokenizer.convert_ids_to_tokens(i) if i < len(tokenizer) else "?" for i in gen_eos]
        report.problems.append(
            f"eos mismatch {both}: the tokenizer's eos is {tokenizer.eos_token!r} (id {tok_eos}) but the model's "
            f"generation_config.eos_token_id is {gen_eos} ({', '.join(map(repr, names))}). Rollouts would not stop "
            "where the model ends its turn, and losses would mask the wrong token. Fix: use the tokenizer that "
            f"ships with the model, or pass eos_token={names[0]!r} to load_hf_model, or correct "
            "generation_config.json.")
        stop = [tok_eos] + gen_eos
    report.stop_token_ids = stop
    if tok_eos is not None and tok_eos >= rows:
        report.problems.append(f"the eos token {tokenizer.eos_token!r} has id {tok_eos} >= the {rows} embedding "
                               f"rows {both}. Fix: use the tokenizer that ships with the model.")
    report.special_tokens.append(SpecialToken("eos", tokenizer.eos_token, tok_eos,
                                              f"generation stops on {stop}" if stop else "none"))
    if fix and stop and gen_config is not None and not report.problems:
        gen_config.eos_token_id = stop if len(stop) > 1 else stop[0]


def _resolve_pad(report: LoadReport, model: Any, tokenizer: Tokenizer, rows: int, both: str, *,
                 pad_token: str | None, fix: bool) -> None:
    note = ""
    if pad_token is not None:
        if _token_id(tokenizer, pad_token) is None:
            report.problems.append(f"pad_token={pad_token!r} is not a single token of the tokenizer {both}. Fix: "
                                   "pass a token the tokenizer has, or leave pad_token unset to use eos.")
            return
        chosen, note = pad_token, "set by pad_token"
    elif tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            report.problems.append(
                f"the tokenizer has no pad token and no eos token to use instead {both}. Fix: pass "
                "pad_token='<a token of the vocabulary>' to load_hf_model.")
            report.special_tokens.append(SpecialToken("pad", None, None, "missing"))
            return
        report.warnings.append(
            f"the tokenizer has no pad token; using eos {tokenizer.eos_token!r} as pad. verl masks padding with "
            "attention masks, so this is safe here; pass pad_token='...' to load_hf_model to choose another token.")
        chosen, note = str(tokenizer.eos_token), "was None, set to eos"
    else:
        chosen = str(tokenizer.pad_token)
    if fix and tokenizer.pad_token != chosen:
        tokenizer.pad_token = chosen
    pad_id = tokenizer.convert_tokens_to_ids(chosen)
    if pad_id is not None and pad_id >= rows:
        report.problems.append(f"the pad token {chosen!r} has id {pad_id} >= the {rows} embedding rows {both}. "
                               "Fix: use the tokenizer that ships with the model or pass pad_token=...")
    if not note and pad_id is not None and pad_id == tokenizer.eos_token_id:
        note = "same as eos"
    report.special_tokens.append(SpecialToken("pad", chosen, pad_id, note))
    if fix and pad_id is not None:
        model.config.pad_token_id = pad_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = pad_id


def _resolve_bos_unk(report: LoadReport, tokenizer: Tokenizer, rows: int, both: str) -> None:
    for role in ("bos", "unk"):
        token = getattr(tokenizer, f"{role}_token")
        token_id = getattr(tokenizer, f"{role}_token_id") if token is not None else None
        report.special_tokens.append(SpecialToken(role, token, token_id, "" if token is not None else "none"))
        if token_id is not None and token_id >= rows:
            report.problems.append(f"the {role} token {token!r} has id {token_id} >= the {rows} embedding rows "
                                   f"{both}. Fix: use the tokenizer that ships with the model.")


def _check_chat_template(report: LoadReport, tokenizer: Tokenizer, reference: Tokenizer | None, rows: int, *,
                         chat: bool | None, model_source: str, tok_src: str, both: str, tokenizer_key: str) -> None:
    own = _template_text(tokenizer)
    ref = _template_text(reference) if reference is not None else None
    if own is None:
        if ref is not None:
            # The instruct model's own template exists: the substitute tokenizer must encode its tokens.
            _check_template_tokens(report, tokenizer, reference, ref, rows, both,
                                   origin=f"the chat template of the model's own tokenizer at {model_source}",
                                   fix_hint=f"drop {tokenizer_key} to use {model_source}'s tokenizer")
            if chat:
                report.problems.append(
                    f"chat formatting is on but tokenizer {tok_src} has no chat template, while the model's own "
                    f"tokenizer at {model_source} has one. Fix: drop {tokenizer_key} (use {model_source}).")
            report.chat_template = "absent (model's own tokenizer has one)"
            return
        if chat:
            report.problems.append(
                f"chat formatting is on but tokenizer {tok_src} has no chat template {both}; a base model's "
                f"tokenizer usually has none. Fix: use the instruct/chat model's tokenizer ({tokenizer_key}=...), "
                "or turn chat formatting off so prompts are used as plain text.")
        report.chat_template = "absent"
        return
    ok = _check_template_tokens(report, tokenizer, tokenizer, own, rows, both,
                                origin=f"the chat template of tokenizer {tok_src}",
                                fix_hint="use the tokenizer that ships with the instruct model")
    report.chat_template = "present, probe ok" if ok else "present, probe FAILED"


def _check_template_tokens(report: LoadReport, tokenizer: Tokenizer, renderer: Tokenizer, template: str, rows: int,
                           both: str, *, origin: str, fix_hint: str) -> bool:
    try:
        text = render_probe(renderer, template=template)
    except Exception as exc:  # noqa: BLE001 - a broken template is a user-facing problem, not a crash
        report.problems.append(f"{origin} failed to render a probe conversation {both}: {exc}. Fix: correct the "
                               "template (tokenizer_config.json / chat_template.jinja) or "
                               f"{fix_hint}.")
        return False
    markers = set(_MARKER_RE.findall(text))
    if renderer is not tokenizer:
        markers |= {t for t in getattr(renderer, "all_special_tokens", []) if t and t in text}
    markers |= {t for t in getattr(tokenizer, "all_special_tokens", []) if t and t in text}
    bad = sorted(m for m in markers if _token_id(tokenizer, m) is None)
    ok = True
    if bad:
        pieces = {m: tokenizer.convert_ids_to_tokens(tokenizer.encode(m, add_special_tokens=False)) for m in bad}
        shown = "; ".join(f"{m!r} -> {p}" for m, p in list(pieces.items())[:4])
        report.problems.append(
            f"{origin} emits special tokens the tokenizer cannot encode as single ids {both}: {shown}. Prompts "
            f"would be fed to the model as fragments of text and it would generate garbage. Fix: {fix_hint}.")
        ok = False
    ids = tokenizer.encode(text, add_special_tokens=False)
    unk = tokenizer.unk_token_id
    if unk is not None and unk in ids:
        report.problems.append(f"{origin} renders a probe conversation that encodes to the unknown token "
                               f"{tokenizer.unk_token!r} {both}. Fix: {fix_hint}.")
        ok = False
    too_big = sorted({i for i in ids if i >= rows})
    if too_big:
        report.problems.append(f"{origin} encodes a probe conversation to ids {too_big[:6]} >= the {rows} "
                               f"embedding rows {both}. Fix: {fix_hint}.")
        ok = False
    return ok


def vocabulary_difference(tokenizer: Tokenizer, reference: Tokenizer,
                          names: tuple[str, str] = ("the tokenizer", "the model's")) -> str | None:
    """How two tokenizers' vocabularies (token -> id, added tokens included) differ, or None if equal;
    `names` say whose each is in the text."""
    ours, theirs = tokenizer.get_vocab(), reference.get_vocab()
    if ours == theirs:
        return None
    only_ours = sorted(set(ours) - set(theirs))
    only_theirs = sorted(set(theirs) - set(ours))
    moved = sorted(t for t in set(ours) & set(theirs) if ours[t] != theirs[t])
    parts = [f"{len(ours)} vs {len(theirs)} tokens"]
    if only_ours:
        parts.append(f"{len(only_ours)} only in {names[0]} (e.g. {only_ours[:3]})")
    if only_theirs:
        parts.append(f"{len(only_theirs)} only in {names[1]} (e.g. {only_theirs[:3]})")
    if moved:
        parts.append(f"{len(moved)} with other ids (e.g. {moved[0]!r}: {ours[moved[0]]} vs {theirs[moved[0]]})")
    return ", ".join(parts)


__all__ = ["LoadReport", "SpecialToken", "check_model_and_tokenizer", "embedding_rows", "render_probe",
           "vocabulary_difference", "PROBE_CONVERSATION", "PROBE_TEXTS"]
