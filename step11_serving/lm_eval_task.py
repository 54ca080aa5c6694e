"""lm-eval 的一个小小的多项选择题任务（20 道"某国的首都是哪里"），在本地文件夹里现做，不下载任何数据集：
第 11 章用它检查 lm-eval 的 local-completions 后端（经我们的服务器：echo + logprobs）与 HF 后端（直接用 transformers）
在同一个模型目录上算出同样的准确率、同样的每题对数似然。

    python step11_serving/lm_eval_task.py [DIR]      # 写出 DIR/capitals.yaml 与 DIR/capitals.jsonl，并打印两条 lm_eval 命令

lm-eval 不在 requirements.txt 里（只有这个例子用）：pip install "lm-eval[api]" accelerate。
"""
import json
import random
import sys
import tempfile
from pathlib import Path

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
            ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Russia", "Moscow"), ("China", "Beijing"), ("Greece", "Athens"),
            ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Norway", "Oslo"), ("Portugal", "Lisbon"), ("Austria", "Vienna"),
            ("Poland", "Warsaw"), ("Ireland", "Dublin"), ("Cuba", "Havana"), ("Sweden", "Stockholm"),
            ("Thailand", "Bangkok")]

TASK_YAML = """task: capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
"""


def questions(seed: int = 0) -> list[dict]:
    """每题一个正确的首都 + 另外三个国家的首都，顺序打乱（固定种子：每次写出同样的 20 题）。"""
    rng, cities = random.Random(seed), [c for _, c in CAPITALS]
    out = []
    for country, capital in CAPITALS:
        choices = rng.sample([c for c in cities if c != capital], 3) + [capital]
        rng.shuffle(choices)
        out.append({"question": f"What is the capital of {country}?", "choices": choices,
                    "answer": choices.index(capital)})
    return out


def write_task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions()), encoding="utf-8")
    (folder / "capitals.yaml").write_text(TASK_YAML.format(data=data.resolve()), encoding="utf-8")
    return folder


if __name__ == "__main__":
    folder = write_task(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="lm_eval_task_")))
    model = Path.home() / ".cache/llm-from-scratch/SmolLM2-135M-Instruct"
    print(f"任务写在 {folder}\n")
    print("# 我们的服务器（先起：python -m step11_serving.api_server --port 8000）")
    print(f"lm_eval --model local-completions --tasks capitals --include_path {folder} --log_samples --output_path out_ours "
          f"--model_args model=SmolLM2-135M-Instruct,base_url=http://127.0.0.1:8000/v1/completions,"
          f"tokenizer_backend=huggingface,tokenizer={model},num_concurrent=1")
    print("# 对照：同一个模型目录直接用 transformers")
    print(f"lm_eval --model hf --model_args pretrained={model},dtype=float32 --tasks capitals --include_path {folder} "
          f"--device cpu --log_samples --output_path out_hf")
