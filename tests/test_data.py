"""Prompt sets: the repaired ShareGPT copy, the held-out split, HumanEval, prompt files."""

from __future__ import annotations

import json

import pytest

from jetflow_sglang.prompts import (
    file_prompts,
    humaneval_prompts,
    is_heldout,
    parse_json_records_leniently,
    sharegpt_path,
    sharegpt_prompts,
)
from jetflow_sglang.errors import JetFlowError


def test_lenient_parse_keeps_complete_records_of_a_truncated_list():
    text = json.dumps([{"id": "a", "x": [1, 2]}, {"id": "b", "x": "}, {"}])[:-1] + ', {"id": "c", "x": [1'
    assert [r["id"] for r in parse_json_records_leniently(text)] == ["a", "b"]
    assert parse_json_records_leniently("[]") == []


def test_sharegpt_copy_is_valid_json_and_splits_are_disjoint():
    records = json.loads(sharegpt_path().read_text(encoding="utf-8"))
    assert len(records) == 17671  # the complete records of the truncated wheel JSON
    train, heldout = sharegpt_prompts("train"), sharegpt_prompts("heldout")
    train_ids, heldout_ids = {p.id for p in train}, {p.id for p in heldout}
    assert not train_ids & heldout_ids
    assert 100 < len(heldout) < len(train) / 20
    assert all(is_heldout(i) for i in heldout_ids) and not any(is_heldout(i) for i in train_ids)
    assert sharegpt_prompts("heldout") == heldout  # deterministic
    validation = sharegpt_prompts("validation")
    assert len(validation) == 64 and not {p.id for p in validation} & (train_ids | heldout_ids)
    assert sum(p.answer is not None for p in validation) > 48  # ShareGPT's own answers ride along


def test_humaneval_prompts_are_raw_code_completions():
    prompts = humaneval_prompts()
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0"
    assert all(p.kind == "code" and "def " in p.text for p in prompts)


def test_prompt_files_json_and_jsonl(tmp_path):
    listed = tmp_path / "p.json"
    listed.write_text(json.dumps([{"prompt": "hi", "kind": "chat"}, {"prompt": "def f():", "kind": "code"}]))
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "hi"}\n{"prompt": "def f():", "kind": "code"}\n')
    assert [p.kind for p in file_prompts(listed)] == ["chat", "code"]
    assert [p.kind for p in file_prompts(lines)] == ["chat", "code"]


@pytest.mark.parametrize("content", ["[", '[{"kind": "chat"}]', '[{"prompt": "x", "kind": "poem"}]', "[]"])
def test_bad_prompt_files_are_refused(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(JetFlowError):
        file_prompts(path)


def test_python_stdlib_prompts_stop_where_the_body_begins(tmp_path):
    from jetflow_sglang.prompts import python_stdlib_prompts

    (tmp_path / "pkg").mkdir()
    (tmp_path / "test").mkdir()
    (tmp_path / "pkg" / "shapes.py").write_text(
        'import math\nfrom os import path\n\n\n'
        'def area(radius):\n    """Return the area of a circle of the given radius, in square units."""\n'
        '    return math.pi * radius ** 2\n\n\n'
        'def short(x):\n    """Too short."""\n    return x\n\n\n'
        'class Box(\n    object,\n):\n    def volume(self, side):\n'
        '        """Return the volume of a cube whose edges are all this long."""\n'
        '        value = side ** 3\n        return value\n'
    )
    (tmp_path / "test" / "test_shapes.py").write_text(
        'def test_area():\n    """A test module: never a prompt, however long its docstring is."""\n    assert True\n'
    )
    (tmp_path / "broken.py").write_text("def (:\n")
    prompts = python_stdlib_prompts(tmp_path)
    by_id = {p.id: p for p in prompts}
    assert set(by_id) == {"pkg.shapes.area:5", "pkg.shapes.Box.volume:18"}
    assert all(p.kind == "code" for p in prompts)
    area = by_id["pkg.shapes.area:5"].text
    assert area.startswith("import math\nfrom os import path\n\n\ndef area(radius):\n")
    assert area.endswith('square units."""\n') and "return" not in area
    volume = by_id["pkg.shapes.Box.volume:18"].text
    assert "class Box(\n    object,\n):\n    def volume(self, side):\n" in volume and "value" not in volume.split('"""')[-1]
    assert python_stdlib_prompts(tmp_path) == prompts  # a fixed order
