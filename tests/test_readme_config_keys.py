"""docs/configs.md (moved there from the README) lists every DeepSpeed key accepted without effect and every
refused one, each with why, exactly as the config code's own tables say (zero_offload.config.keys)."""
from pathlib import Path

from zero_offload.config.keys import accepted_without_effect, markdown_table, refused

README = (Path(__file__).parent.parent / "docs" / "configs.md").read_text()


def test_readme_lists_the_keys_accepted_without_effect_with_why():
    assert markdown_table(accepted_without_effect()) in README, "run python -m zero_offload.config.keys"


def test_readme_lists_the_refused_keys_with_why():
    assert markdown_table(refused()) in README, "run python -m zero_offload.config.keys"


def test_every_table_row_is_a_key_the_config_really_treats_so(recwarn):
    import pytest

    import zero_offload
    base = {"train_batch_size": 1, "optimizer": {"type": "Adam"}}
    for key, _ in accepted_without_effect()[:5]:          # top-level rows: one warning each, no error
        zero_offload.Config.from_dict({**base, key: {}})
        assert any(key in str(w.message) for w in recwarn.list), key
    for key in ("nebula", "amp"):
        with pytest.raises(zero_offload.ConfigError, match=key):
            zero_offload.Config.from_dict({**base, key: {}})
