"""A run folder's ``config.json`` read back like a message (issue 26, finding 8: "a traceback for an
unknown ``config.json`` key"): whatever a hostile or damaged file holds, ``--resume`` and ``vfl predict``
get one line naming the file, never a traceback from the dataclass."""

from __future__ import annotations

import json

import pytest

from parties.config import ConfigError
from parties.resume import load_run


@pytest.mark.parametrize("text", ['{"options": {}, "bogus": 1}', '{"unknown_key": 1}', "[1, 2]", "{",
                                  '"a string"', "null", '{"options": [1]}', '{"options": {"parties": "x"}}'])
def test_a_config_json_with_an_unknown_key_or_of_another_shape_is_one_line(tmp_path, text) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=r"config\.json is damaged \(") as caught:
        load_run(tmp_path)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 500


def test_a_real_plans_config_json_with_an_unknown_option_loads_without_it(tmp_path) -> None:
    """Keys the plan does not know are left out (a folder from another version still resumes); they can
    neither add an option nor raise."""
    from parties.config import RunConfig
    from parties.plan import JobPlan

    plan = json.loads(JobPlan.of(RunConfig(parties=3, active=1)).to_json())
    plan["options"]["injected"] = "x"  # an unknown option inside the plan
    (tmp_path / "config.json").write_text(json.dumps(plan))
    assert not hasattr(load_run(tmp_path).options, "injected")


def test_every_test_the_audit_table_names_exists() -> None:
    """docs/security.md maps each finding of issue 26 to tests; each ``file::name`` must be a test there."""
    import re

    from tests.conftest import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "security.md").read_text()
    table = doc[doc.index("## The hostile-party audit"):]
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", table)
    rows = re.findall(r"^\| (\d)\. ", table, re.MULTILINE)
    assert rows == [str(k) for k in range(1, 10)] and len(named) >= 9
    for path, name in named:
        assert re.search(rf"^def {name}\(", (REPO_ROOT / path).read_text(), re.MULTILINE), f"{path}::{name}"
