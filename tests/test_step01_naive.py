"""step01：朴素引擎的贪心输出与 HF transformers 的 generate 逐 token 一致（参考实现不是我们写的）。"""
import json

import pytest
import torch

from common.compare import MARGIN_TOL, compare
from common.hf_reference import hf_greedy, hf_logits, load_hf_model
from common.prompts import CHAPTER_PROMPTS
from conftest import run_py
from step01_naive.engine import generate


@pytest.fixture(scope="module")
def hf(real):
    return load_hf_model(real.path, "cpu", torch.float32)


# 两个章节提示词够了（一个续写、一个套对话模板）：run.py 的章节模式在真实模型上对全部四个都与 HF 比
HF_PROMPTS = [CHAPTER_PROMPTS[0], CHAPTER_PROMPTS[3]]


@pytest.mark.parametrize("name,text,chat", HF_PROMPTS, ids=[p[0] for p in HF_PROMPTS])
def test_greedy_equals_hf_generate(real, hf, name, text, chat):
    ids = real.encode(text, chat)
    ref = hf_greedy(hf, ids, 24, real.tok.eos_ids)
    got = generate(real.model, ids, 24, real.tok.eos_ids)
    c = compare(name, ids, ref, got, lambda t: hf_logits(hf, t), MARGIN_TOL[torch.float32])
    assert c.ok, c.describe()


def test_stops_on_eos_like_hf(real, hf):
    """对话提示词会自然以 EOS 结束：停下的位置与 HF 相同，且输出包含这个 EOS。"""
    ids = real.encode("Reply with one word: yes or no?", chat=True)
    ref = hf_greedy(hf, ids, 40, real.tok.eos_ids)
    got = generate(real.model, ids, 40, real.tok.eos_ids)
    assert got == ref and got[-1] in real.tok.eos_ids and len(got) < 40


def test_ignore_eos_continues_past_eos(real, hf):
    ids = real.encode("Reply with one word: yes or no?", chat=True)
    ref = hf_greedy(hf, ids, 12, real.tok.eos_ids, ignore_eos=True)
    got = generate(real.model, ids, 12, real.tok.eos_ids, ignore_eos=True)
    assert got == ref and len(got) == 12
    assert any(t in real.tok.eos_ids for t in got[:-1])  # 这条提示词的 EOS 确实出现在中间，之后仍继续生成


def test_compare_rejects_a_real_difference(real, hf):
    """比较函数本身能失败：随便改一个 token（不是近似打平的位置）必须被判为不一致。"""
    ids = real.encode("The three primary colors are")
    ref = hf_greedy(hf, ids, 8, real.tok.eos_ids)
    bad = ref[:3] + [ref[3] + 1] + ref[4:]
    c = compare("tampered", ids, ref, bad, lambda t: hf_logits(hf, t), MARGIN_TOL[torch.float32])
    assert not c.ok and c.position == 3 and c.margin > 1e-3


def test_run_py_generation_mode_equals_hf(real, hf):
    """命令行：任意提示词 + --ignore-eos 正好 16 个 token，与 HF 贪心 generate 相同。"""
    prompt = "Once upon a time, in a small village by the sea,"
    r = run_py("step01_naive", "--prompt", prompt, "--max-new-tokens", "16", "--ignore-eos", "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])["results"][0]
    assert res["prompt_ids"] == real.encode(prompt)
    ref = hf_greedy(hf, res["prompt_ids"], 16, real.tok.eos_ids, ignore_eos=True)
    c = compare("cli", res["prompt_ids"], ref, res["output_ids"], lambda t: hf_logits(hf, t), MARGIN_TOL[torch.float32])
    assert c.ok and len(res["output_ids"]) == 16, c.describe()
