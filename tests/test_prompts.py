"""Named prompt sets read from a data folder."""

import json

from dflash.prompts import read_prompts


def _mbpp(tmp_path, records):
    (tmp_path / "mbpp").mkdir()
    (tmp_path / "mbpp" / "mbpp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_mbpp_train_tasks_are_posed_as_humaneval_stubs_and_test_tasks_never(tmp_path):
    code = "import math\r\ndef helper(x):\r\n  return x\r\ndef area(r): \r\n  return math.pi * helper(r) ** 2"
    data = _mbpp(tmp_path, [
        {"task_id": 700, "text": "Write a function for a circle's area.", "code": code,
         "test_list": ["assert area(1) == 3.141592653589793", "assert math.isclose(area(2), 12.566)"]},
        {"task_id": 20, "text": "A test task.", "code": "def f(x):\r\n  return x", "test_list": ["assert f(1) == 1"]},
        # nothing the tests call is defined: left out, not posed without a signature
        {"task_id": 701, "text": "Odd.", "code": "g = len", "test_list": ["assert g([1]) == 1"]},
    ])
    prompts = read_prompts(["mbpp:train-complete"], data_dir_path=data)
    assert [p.meta["task_id"] for p in prompts] == [700]
    assert prompts[0].messages[0]["content"] == (
        "Complete the following Python function:\n```python\nimport math\n\ndef area(r):\n"
        '    """ Write a function for a circle\'s area.\n    >>> area(1)\n    3.141592653589793\n    """\n```')
    # the plain train split is unchanged beside it
    assert read_prompts(["mbpp:train"], data_dir_path=data)[0].messages[0]["content"].startswith("Write a function")
