"""第 11 章 lm-eval 例子的本地题库：写出来的文件是 lm-eval 读得懂的样子，每题恰好一个正确答案。"""
import json

from step11_serving.lm_eval_task import CAPITALS, questions, write_task


def test_task_files_are_complete_and_each_question_has_its_capital(tmp_path):
    folder = write_task(tmp_path / "task")
    rows = [json.loads(line) for line in (folder / "capitals.jsonl").read_text(encoding="utf-8").splitlines()]
    assert rows == questions() and len(rows) == len(CAPITALS) == 20
    for (country, capital), q in zip(CAPITALS, rows):
        assert country in q["question"] and len(set(q["choices"])) == 4 and q["choices"][q["answer"]] == capital
    yaml = (folder / "capitals.yaml").read_text(encoding="utf-8")
    assert "task: capitals" in yaml and str((folder / "capitals.jsonl").resolve()) in yaml
    assert "{{question}}" in yaml and "{{choices}}" in yaml and "output_type: multiple_choice" in yaml
