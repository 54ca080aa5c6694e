"""step04：静态批处理。每个请求在批里的输出与 step03 单独生成相同（贪心与带种子采样）；
左填充的掩码与位置 id、三种浪费的记账都对照手算的小例子。"""
import json

import pytest
import torch

from common.compare import MARGIN_TOL, compare
from common.errors import UserError
from conftest import cli_error, one_arch, run_py
from step02_sampling.sampler import SamplingParams
from step03_kvcache_single.engine import generate as generate_step03
from step04_static_batching import batch
from step04_static_batching import run as step04_run
from step04_static_batching.batch import PAD_ID, attention_mask, left_pad, positions
from step04_static_batching.engine import generate_batch, split_batches
from step04_static_batching.request import Request

# 长度差别很大的提示词与各不相同的新 token 上限（随机小模型的词表是 256）
PROMPT_LENS = (3, 17, 1, 40, 9, 26)
MAX_NEW = (5, 12, 8, 3, 10, 7)


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def logits_fn(model):
    """teacher-forcing 参考：整段重算一次前向 (T, V)，给 compare 判断分歧位置是不是近似打平。"""
    @torch.inference_mode()
    def fn(ids):
        return model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    return fn


def step03_outputs(model, requests, eos_ids):
    return [generate_step03(model, r.prompt_ids, r.max_new_tokens, r.params, eos_ids, r.ignore_eos)
            for r in requests]


# ---- 左填充、位置 id、掩码：对照手写的结果 ----

def test_left_pad_and_prefill_positions_hand_example():
    ids, pad = left_pad([[5, 6], [7, 8, 9, 10], [11]], "cpu")
    P = PAD_ID
    assert ids.tolist() == [[P, P, 5, 6], [7, 8, 9, 10], [P, P, P, 11]]
    assert pad.tolist() == [2, 0, 3]
    # 每行从自己的第一个真实 token 起算 0；填充列取 0
    assert positions(pad, 0, 4).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]]


def test_prefill_mask_hand_example():
    _, pad = left_pad([[5, 6], [7, 8, 9, 10], [11]], "cpu")
    mask = attention_mask(pad, 0, 4)
    assert mask.shape == (3, 1, 1, 4, 4) and mask.dtype == torch.bool
    T, F = True, False
    expected = [
        # 行 0：第 2、3 列是真实 token；填充列的 query 什么都看不到（整行被遮住，模型里不会出 NaN）
        [[F, F, F, F], [F, F, F, F], [F, F, T, F], [F, F, T, T]],
        # 行 1：没有填充，就是普通的下三角因果掩码
        [[T, F, F, F], [T, T, F, F], [T, T, T, F], [T, T, T, T]],
        # 行 2：只有最后一列是真实 token
        [[F, F, F, F], [F, F, F, F], [F, F, F, F], [F, F, F, T]],
    ]
    assert mask[:, 0, 0].tolist() == expected


def test_decode_mask_and_positions_hand_example():
    """decode 第一步：第 4 列，一个 query 看得到本行所有非填充列（含自己）。"""
    _, pad = left_pad([[5, 6], [7, 8, 9, 10], [11]], "cpu")
    T, F = True, False
    assert attention_mask(pad, 4, 1)[:, 0, 0].tolist() == [[[F, F, T, T, T]], [[T, T, T, T, T]], [[F, F, F, T, T]]]
    assert positions(pad, 4, 1).tolist() == [[2], [4], [1]]   # = 提示词长度：接着各自的提示词往下数


# ---- 三种浪费的记账：对照手算 ----

@one_arch
def test_waste_accounting_hand_example(tiny):
    """提示词长 2、5、3，--ignore-eos 分别生成 4、1、2 个 token，一批（B = 3）：
    prefill：P = 5，15 个槽位里填充 3 + 0 + 2 = 5 个。
    decode：最长的行要 4 - 1 = 3 次 decode 前向，共 9 行·步；真正在生成的只有 (4-1) + (1-1) + (2-1) = 4，空转 5。
      （逐步数：第 1 步行 1 已结束；第 2、3 步行 1、2 已结束 → 1 + 2 + 2 = 5）
    KV：max_len = 5 + 4 - 1 = 8，每次前向后都持有 3 × 8 = 24 个槽，共 4 次前向 → 96 槽·步。
      每次前向后存着真实 token 的槽（提示词 + 已喂回的输出；已结束的行最后一个输出从没喂回）：
      第 1 次 2+5+3 = 10；第 2 次 3+5+4 = 12；第 3 次 4+5+4 = 13；第 4 次 5+5+4 = 14 → 49。KV 浪费 = 1 − 49/96。"""
    reqs = [Request(list(range(2, 2 + n)), m, ignore_eos=True) for n, m in ((2, 4), (5, 1), (3, 2))]
    outputs, st = generate_batch(tiny.model, reqs, 3, eos_ids=())
    assert [len(o) for o in outputs] == [4, 1, 2]
    assert (st.prefill_steps, st.num_forwards, st.generated_tokens) == (1, 4, 7)
    assert (st.prefill_padding_slots, st.prefill_slots) == (5, 15)
    assert (st.decode_idle_row_steps, st.decode_row_steps) == (5, 9)
    assert [x.kv_slots_used for x in st.steps] == [10, 12, 13, 14]
    assert (st.kv_slot_steps_used, st.kv_slot_steps_held, st.peak_kv_slots_held) == (49, 96, 24)
    assert st.prefill_padding_waste == pytest.approx(5 / 15)
    assert st.decode_idle_waste == pytest.approx(5 / 9)
    assert st.kv_waste == pytest.approx(1 - 49 / 96)


@one_arch
def test_waste_accounting_two_batches_hand_example(tiny):
    """同样三个请求，--max-batch-size 2 → 批 [0, 1] 和 [2]。
    批 1：P = 5，填充 3/10；decode 3 步 × 2 行 = 6，空转 3（行 1 三步都在陪跑）；
          KV 持有 2 × 8 = 16 槽 × 4 次前向，真实 7、8、9、10。
    批 2：P = 3，无填充 0/3；decode 1 步 × 1 行，空转 0；KV 持有 1 × (3 + 2 - 1) = 4 槽 × 2 次前向，真实 3、4。"""
    reqs = [Request(list(range(2, 2 + n)), m, ignore_eos=True) for n, m in ((2, 4), (5, 1), (3, 2))]
    outputs, st = generate_batch(tiny.model, reqs, 2, eos_ids=())
    assert [len(o) for o in outputs] == [4, 1, 2]
    assert (st.prefill_steps, st.num_forwards) == (2, 4 + 2)
    assert (st.prefill_padding_slots, st.prefill_slots) == (3, 13)
    assert (st.decode_idle_row_steps, st.decode_row_steps) == (3, 7)
    assert [x.kv_slots_used for x in st.steps] == [7, 8, 9, 10, 3, 4]
    assert (st.kv_slot_steps_used, st.kv_slot_steps_held, st.peak_kv_slots_held) == (41, 72, 16)


@one_arch
def test_per_request_times_are_recorded(tiny):
    """每个请求的首 token 与结束时刻：批 2 的请求要等批 1 跑完才有首 token；TPOT 只对输出 ≥ 2 个的请求有定义。"""
    reqs = [Request(list(range(2, 2 + n)), m, ignore_eos=True) for n, m in ((2, 4), (5, 1), (3, 2))]
    _, st = generate_batch(tiny.model, reqs, 2, eos_ids=())
    assert st.num_outputs == [4, 1, 2] and st.stall_s == [0.0, 0.0, 0.0]
    assert all(0 < t <= f <= st.wall_s for t, f in zip(st.first_token_s, st.finish_s))
    assert st.first_token_s[0] == st.first_token_s[1] < st.finish_s[0] <= st.first_token_s[2]   # 同批同一次 prefill
    assert st.first_token_s[1] == st.finish_s[1]                                                 # 只生成 1 个
    tpot = st.tpot_s()
    assert tpot[1] is None and tpot[0] == pytest.approx((st.finish_s[0] - st.first_token_s[0]) / 3)
    assert sum(x.seconds for x in st.steps) <= st.wall_s


def test_split_batches_by_size_and_kv_budget():
    """按到达顺序切批；给了 KV 预算时，每批预留 B × (最长提示词 + 最大 max_new − 1) 不能超出。
    预算 40 槽：前两个 2 × (10 + 6 − 1) = 30 放得下；加第三个要 3 × (30 + 6 − 1) = 105，只好另开一批。"""
    reqs = [Request([1] * 10, 6), Request([1] * 10, 6), Request([1] * 30, 6)]
    assert split_batches(reqs, 8) == [range(0, 3)]
    assert split_batches(reqs, 2) == [range(0, 2), range(2, 3)]
    assert split_batches(reqs, 8, max_kv_slots=40) == [range(0, 2), range(2, 3)]
    with pytest.raises(UserError, match="alone needs 35 KV slots"):
        split_batches(reqs, 8, max_kv_slots=34)


# ---- 与 step03 单独生成逐 token 相同 ----

@one_arch
def test_greedy_equals_step03_with_natural_eos(tiny):
    """贪心，含逐行的 EOS：拿某个请求单独生成时的第 3 个 token 当 EOS，让至少一行在中途自然结束、继续陪跑。"""
    ps = prompts()
    eos = (step03_outputs(tiny.model, [Request(ps[0], MAX_NEW[0])], ())[0][2],)
    reqs = [Request(p, m) for p, m in zip(ps, MAX_NEW)]
    refs = step03_outputs(tiny.model, reqs, eos)
    assert any(len(r) < m for r, m in zip(refs, MAX_NEW))          # 确实有行因 EOS 提前结束
    for max_batch_size in (len(reqs), 4):                          # 一批；两批（4 + 2）
        outputs, _ = generate_batch(tiny.model, reqs, max_batch_size, eos)
        for i, (r, ref, got) in enumerate(zip(reqs, refs, outputs)):
            c = compare(f"req{i}", r.prompt_ids, ref, got, logits_fn(tiny.model), MARGIN_TOL[torch.float32])
            assert c.ok, c.describe()


@one_arch
def test_seeded_sampling_equals_step03(tiny):
    """带种子采样：每个请求自己的种子和发生器；重复惩罚要用到每行自己的 history。逐 token 完全相同。"""
    reqs = [Request(p, m, SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=10 + i))
            for i, (p, m) in enumerate(zip(prompts(1), MAX_NEW))]
    refs = step03_outputs(tiny.model, reqs, (1,))
    outputs, _ = generate_batch(tiny.model, reqs, len(reqs), (1,))
    assert outputs == refs


@one_arch
def test_seed_follows_the_request_not_the_row(tiny):
    """同一个带种子的请求放在批里不同的行、和不同的邻居一起，输出都一样（随机数不在行之间共享）。"""
    ps = prompts(2)
    params = SamplingParams(temperature=1.0, seed=5)
    target = Request(ps[1], 10, params, ignore_eos=True)
    others = [Request(p, 6, SamplingParams(temperature=1.0, seed=99), ignore_eos=True) for p in ps[2:5]]
    first, _ = generate_batch(tiny.model, [target] + others, 8, ())
    last, _ = generate_batch(tiny.model, others + [target], 8, ())
    assert first[0] == last[-1] == step03_outputs(tiny.model, [target], ())[0]


@one_arch
def test_alone_equals_in_batch(tiny):
    """填充不改变输出：每个请求单独成批（没有填充）与在批里被左填充到最长时给出相同的 token。"""
    reqs = [Request(p, m, ignore_eos=True) for p, m in zip(prompts(3), MAX_NEW)]
    in_batch, _ = generate_batch(tiny.model, reqs, len(reqs), ())
    for i, (r, got) in enumerate(zip(reqs, in_batch)):
        alone, st = generate_batch(tiny.model, [r], 1, ())
        assert st.prefill_padding_slots == 0
        c = compare(f"req{i}", r.prompt_ids, alone[0], got, logits_fn(tiny.model), MARGIN_TOL[torch.float32])
        assert c.ok, c.describe()


@one_arch
def test_padding_is_invisible_to_real_tokens(tiny, monkeypatch):
    """更直接：填充位置放什么 token 都不该影响输出（被遮住的 key 的权重正好是 0）。换一个 PAD_ID，结果逐位相同。"""
    reqs = [Request(p, 4, ignore_eos=True) for p in prompts(4)]
    before, _ = generate_batch(tiny.model, reqs, len(reqs), ())
    monkeypatch.setattr(batch, "PAD_ID", 77)
    after, _ = generate_batch(tiny.model, reqs, len(reqs), ())
    assert after == before


# ---- 输入检查 ----

@pytest.mark.parametrize("bad", [
    dict(max_batch_size=0),
    dict(request=Request([], 4)),
    dict(request=Request([3, 4], 0)),
    dict(request=Request([3, 4], 511)),                          # 2 + 511 > 上下文 512
    dict(request=Request([3, 4], 4, SamplingParams(top_p=0.0))),
], ids=["batch0", "empty_prompt", "zero_new_tokens", "too_long", "bad_top_p"])
@one_arch
def test_bad_input_raises_user_error_before_any_work(tiny, bad):
    """坏请求排在第二批（批大小 1）：要是边跑边检查，第一批早就做过前向了。这里一次前向都不许有。"""
    reqs = [Request([3, 4, 5], 4), bad.get("request", Request([6], 2))]
    forwards = []
    handle = tiny.model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(UserError):
            generate_batch(tiny.model, reqs, bad.get("max_batch_size", 1), ())
    finally:
        handle.remove()
    assert not forwards, f"{len(forwards)} forwards ran before the error"


def test_cli_bad_max_batch_size(capsys):
    assert "--max-batch-size" in cli_error(step04_run, ["--prompt", "hi", "--max-batch-size", "0"], capsys)


# ---- 命令行生成模式：所有提示词一起跑，每个与 step03 单独生成相同 ----

def test_run_py_generation_mode_equals_step03(real):
    texts = ["Hi", "The three primary colors are", "Below is a long story. " * 12 + "The end of the story is"]
    r = run_py("step04_static_batching", *sum((["--prompt", t] for t in texts), []), "--max-new-tokens", "8",
               "--ignore-eos", "--max-batch-size", "2", "--json")
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    assert [res["prompt"] for res in results] == texts                 # 按给出的顺序
    for res in results:
        assert res["prompt_ids"] == real.encode(res["prompt"])
        ref = generate_step03(real.model, res["prompt_ids"], 8, SamplingParams(), real.tok.eos_ids, ignore_eos=True)
        c = compare(res["prompt"][:20], res["prompt_ids"], ref, res["output_ids"], real.full_logits,
                    MARGIN_TOL[torch.float32])
        assert c.ok and len(res["output_ids"]) == 8, c.describe()


def test_run_py_stop_strings_equal_step03(real):
    """--stop 与 step02/03 同一语义：每个请求在批里被停止字符串截断的位置与 step03 单独生成相同。"""
    texts = ["The three primary colors are", "Paris is the capital of", "def add(a, b):"]
    stop = [",", "\n"]
    r = run_py("step04_static_batching", *sum((["--prompt", t] for t in texts), []), "--max-new-tokens", "16",
               *sum((["--stop", x] for x in stop), []), "--json")
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    lengths = []
    for res in results:
        ref = generate_step03(real.model, res["prompt_ids"], 16, SamplingParams(), real.tok.eos_ids,
                              stop_strings=stop, tokenizer=real.tok)
        c = compare(res["prompt"], res["prompt_ids"], ref, res["output_ids"], real.full_logits, MARGIN_TOL[torch.float32])
        assert c.ok, c.describe()
        lengths.append(len(ref))
    assert min(lengths) < 16                        # 至少一个请求确实被停止字符串截断
    r = run_py("step04_static_batching", "--prompt", "hi", "--stop", "")
    assert r.returncode == 2 and r.stderr.startswith("error:")
