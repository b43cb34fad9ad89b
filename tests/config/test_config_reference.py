"""docs/config.md is the generator's output for the current schema, and covers every key."""

from verl.config.reference import COMMAND, DOC_PATH, RunConfig, render, rows


def test_docs_config_md_is_generated_from_the_schema():
    current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
    assert current == render(), f"docs/config.md is stale: regenerate it with `{COMMAND}` and commit it"


def test_every_key_is_documented_with_a_description():
    keys = {key: text for name, field in RunConfig.model_fields.items()
            for key, _, _, text in rows(type(getattr(RunConfig(), name)), name)}
    assert "actor.lr" in keys and "model.lora.rank" in keys and "fsdp.mixed_precision.param_dtype" in keys
    missing = sorted(key for key, text in keys.items() if not text)
    assert not missing, (f"config keys without a description: {missing}; add `description=` in "
                         f"verl/config/schema.py (or an entry in NOTES, verl/config/reference.py), then run "
                         f"`{COMMAND}`")
