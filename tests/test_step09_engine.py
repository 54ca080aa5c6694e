"""step09 引擎：投机解码走完整的引擎（随机小模型）。

- spec none 与 step08 逐位相同（同样的输出、同样的前向次数）；贪心的 ngram / 草稿模型（自己当草稿、另一个小模型当草稿）
  与 step08 逐 token 相同；自己当草稿时接受率 100%，加了噪声的自己当草稿时接受一部分、拒绝一部分；
- 只猜留得下的：每个请求不超过 max_new_tokens 还剩的减 1，一步的猜测不超过预算减 decode 数，草稿只走这么多步；
  草稿模型的前向也守 token 预算（新请求的整段提示词分几步追上）；抢占时草稿为它存的状态和块也还回去
  （这几条 step10 的拷贝也跑一遍）；
- 脚本化的猜测（FakeProposer）：在第一个 / 中间 / 最后一个位置猜错、全对（奖励 token）、k = 0；EOS、停止字符串落在
  被接受的一串里；max_new_tokens 在一串中间到达；每步每个请求产出的 token 数正好是"接受的 + 1"；
- 分页的账：被拒绝的猜测回滚（num_computed_tokens）、从不登记进前缀缓存；小池子里抢占（重算 / 换出）、分块 prefill
  照常工作；结束后全部块（包括草稿模型自己的池子）都还回来；
- 接受率一直很低的请求暂停猜测；
- 抽样在分布上精确：带种子抽几千个请求，前几个 token 的联合分布与直接抽样的理论分布一致；规则改坏后检查失败。
"""
import json

import pytest
import torch

from common.errors import UserError
from common.linear import resolve_linear, use_linear_
from common.weights import load_model
from conftest import cli_error, make_tiny_model_dir, one_arch
from step02_sampling.distribution import hf_filtered_probs, tv_bound, tv_distance
from step02_sampling.sampler import SamplingParams
from step04_static_batching.request import Request
from step08_kv_quant import engine as step08
from step09_speculative import engine as step09
from step09_speculative import rejection_sampler
from step09_speculative.engine import SPEC_PAUSE_STEPS, SPEC_WINDOW, EngineConfig, LLMEngine, SpecStats
from step09_speculative.proposer import FakeProposer
from step10_tensor_parallel import engine as step10

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=5)


def prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(2, 256, (length,), generator=g).tolist() for length in (5, 17, 33, 8, 12)[:n]]
    return out[:-1] + [[5, 6, 7, 8] * 3] if n == 5 else out    # 最后一个自己重复：prompt lookup 一定找得到


def requests(params=GREEDY, max_new: int = 24, ps=None, **kw) -> list[Request]:
    return [Request(p, max_new, params, ignore_eos=True, **kw) for p in (ps or prompts())]


def reference(model, reqs, **cfg) -> list[list[int]]:
    """step08 的引擎（同样的池子、批、预算）给出的输出：要对比的参照。"""
    return step08.LLMEngine(model, step08.EngineConfig(**{**dict(num_blocks=64, block_size=4), **cfg})).generate(reqs).outputs


def spec_engine(model, proposer=None, eos_ids=(), draft=None, step=step09, **cfg) -> LLMEngine:
    """step：引擎所在的模块（step10 的投机解码是 step09 的拷贝，有的测试两份都跑）。"""
    return step.LLMEngine(model, step.EngineConfig(**{**dict(num_blocks=64, block_size=4), **cfg}), eos_ids=eos_ids,
                          proposer=proposer, draft_model=draft)


def assert_all_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    draft_bm = getattr(engine.proposer, "block_manager", None)
    if draft_bm is not None:
        assert draft_bm.num_free_blocks == draft_bm.num_blocks and not engine.proposer.states


def continuation_proposer(truth: dict, k: int, wrong_at=None) -> FakeProposer:
    """按参照输出猜：truth[tuple(prompt)] 是那个请求的全部输出；猜接下来的 k 个，第 wrong_at 个故意猜错。"""
    def script(token_ids):
        for prompt, out in truth.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                guess = list(out[done:done + k])
                if wrong_at is not None and wrong_at < len(guess):
                    guess[wrong_at] = (guess[wrong_at] + 1) % 256
                return guess
        raise AssertionError("unknown request")
    return FakeProposer(script)


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory):
    """"不完全一样"的草稿模型：与 llama 的 tiny 同样的权重，每个权重矩阵加上它自己标准差 10% 的噪声——猜测一部分对、
    一部分错。（另一个随机种子的小模型几乎一个都猜不对：接受数是 0，检查不出"接受一部分、拒绝一部分"。）"""
    model = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("draft"), "llama"), "cpu", torch.float32, "plain")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for w in model.parameters():
            w.add_(torch.randn(w.shape, generator=g) * w.std(correction=0) * 0.1)   # RMSNorm 的权重全是 1：std 0，不动
    return use_linear_(model, resolve_linear("auto", "cpu", torch.float32))      # 加了噪声之后再像默认那样打包


# ---------------------------------------------------------------- 与 step08 相同

@one_arch
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_spec_none_is_step08_bit_for_bit(tiny, params):
    reqs = requests(params)
    ref = step08.LLMEngine(tiny.model, step08.EngineConfig(64, 4, max_num_batched_tokens=16)).generate(reqs)
    eng = spec_engine(tiny.model, max_num_batched_tokens=16)
    out = eng.generate(reqs)
    assert out.outputs == ref.outputs
    assert out.stats.num_forwards == ref.stats.num_forwards
    assert eng.spec_stats.proposed == 0


@pytest.mark.parametrize("attention", ["paged", "gather"])
def test_greedy_ngram_equals_step08(tiny, attention):
    reqs = requests()
    eng = spec_engine(tiny.model, spec_method="ngram", num_spec_tokens=3, ngram_min=1, ngram_max=3, attention=attention)
    out = eng.generate(reqs)
    assert out.outputs == reference(tiny.model, reqs, attention=attention)
    assert eng.spec_stats.accepted > 0                           # 真的有猜中的：不是一路照常 decode
    assert out.stats.num_forwards < 5 + 5 * 23                   # 少于"每个 token 一次前向"
    assert_all_free(eng)


@one_arch
def test_self_draft_accepts_everything_and_equals_step08(tiny):
    reqs = requests()
    eng = spec_engine(tiny.model, spec_method="draft", num_spec_tokens=3, draft=tiny.model)
    out = eng.generate(reqs)
    assert out.outputs == reference(tiny.model, reqs)
    assert eng.spec_stats.proposed > 0 and eng.spec_stats.accepted == eng.spec_stats.proposed
    assert_all_free(eng)


@one_arch
def test_other_draft_model_equals_step08(tiny, other_tiny):
    reqs = requests()
    eng = spec_engine(tiny.model, spec_method="draft", num_spec_tokens=2, draft=other_tiny)
    out = eng.generate(reqs)
    assert out.outputs == reference(tiny.model, reqs)
    assert eng.spec_stats.proposed > 0 and 0 < eng.spec_stats.accepted < eng.spec_stats.proposed
    assert_all_free(eng)


# ---------------------------------------------------------------- 脚本化的猜测

def run_steps(eng: LLMEngine, reqs) -> dict[int, list[list[int]]]:
    """一步一步跑，记下每个请求每一步产出的 token。"""
    ids = [eng.add_request(r) for r in reqs]
    per_step = {rid: [] for rid in ids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            per_step[o.request_id].append(o.new_token_ids)
    return per_step


@one_arch
@pytest.mark.parametrize("wrong_at", [0, 1, 2, None], ids=["first", "middle", "last", "all_right"])
def test_scripted_proposals(tiny, wrong_at, monkeypatch):
    monkeypatch.setattr("step09_speculative.engine.SPEC_MIN_ACCEPTANCE", 0.0)   # 不暂停：每一步都验证
    reqs = requests(max_new=21)
    ref = reference(tiny.model, reqs)
    k = 3
    eng = spec_engine(tiny.model, continuation_proposer({tuple(r.prompt_ids): o for r, o in zip(reqs, ref)}, k, wrong_at))
    per_step = run_steps(eng, reqs)
    assert [sum(chunks, []) for chunks in per_step.values()] == ref
    for chunks in per_step.values():
        assert chunks[0] == chunks[0][:1]                        # prefill 那一步：1 个 token
        per_verify = 1 + (k if wrong_at is None else wrong_at)   # 接受的猜测 + 一个更正（全对时是奖励 token）
        # 20 个 decode 出的 token 按 per_verify 一组；最后一组可能被 max_new_tokens 截短（猜测先被截短）
        assert [len(c) for c in chunks[1:-1]] == [per_verify] * (len(chunks) - 2)
    accepted = k if wrong_at is None else wrong_at   # 每次验证接受几个（每个请求最后一次的猜测可能被截短）
    st = eng.spec_stats
    assert accepted * (st.verifications - len(reqs)) <= st.accepted <= accepted * st.verifications
    assert_all_free(eng)


@one_arch
def test_k0_proposals_are_plain_decoding(tiny):
    reqs = requests(SEEDED)
    eng = spec_engine(tiny.model, FakeProposer(lambda ids: []))
    out = eng.generate(reqs)
    ref = step08.LLMEngine(tiny.model, step08.EngineConfig(64, 4)).generate(reqs)
    assert out.outputs == ref.outputs and out.stats.num_forwards == ref.stats.num_forwards


@one_arch
def test_eos_inside_the_accepted_run_stops_there(tiny, monkeypatch):
    monkeypatch.setattr("step09_speculative.engine.SPEC_MIN_ACCEPTANCE", 0.0)
    reqs = requests(max_new=20)
    ref = reference(tiny.model, reqs)
    # 猜 4 个全对时第二个请求每步产出输出的第 1–5、6–10、11–15 个 token：拿一串中间的某个 token 当 EOS
    j = next(j for j in (8, 9, 7, 13, 12, 14) if ref[1][j] not in ref[1][:j])
    eos = ref[1][j]
    reqs_eos = [Request(r.prompt_ids, 20, GREEDY) for r in reqs]
    ref_eos = step08.LLMEngine(tiny.model, step08.EngineConfig(64, 4), eos_ids=[eos]).generate(reqs_eos).outputs
    assert ref_eos[1] == ref[1][:j + 1]
    eng = spec_engine(tiny.model, continuation_proposer({tuple(r.prompt_ids): o for r, o in zip(reqs, ref)}, 4),
                      eos_ids=[eos])
    ids = [eng.add_request(r) for r in reqs_eos]
    got, last = {rid: [] for rid in ids}, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            last[o.request_id] = o
    assert list(got.values()) == ref_eos
    assert last[ids[1]].finish_reason == "stop" and last[ids[1]].new_token_ids[-1] == eos
    assert len(last[ids[1]].new_token_ids) > 1       # EOS 是一串被接受的猜测里的一个：同一步里它前面还有别的 token
    assert_all_free(eng)


class LetterTokenizer:
    """把 token id 映成字母：停止字符串的测试用。"""
    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@one_arch
def test_stop_string_inside_the_accepted_run(tiny):
    reqs = requests(max_new=20)
    ref = reference(tiny.model, reqs)
    tok = LetterTokenizer()
    stop = tok.decode(ref[0][5:7])                   # 第一个请求的第 6、7 个 token 组成的字符串
    cut = next(i for i in range(1, 21) if stop in tok.decode(ref[0][:i]))
    eng = LLMEngine(tiny.model, EngineConfig(64, 4), tokenizer=tok,
                    proposer=continuation_proposer({tuple(r.prompt_ids): o for r, o in zip(reqs, ref)}, 4))
    out = eng.generate([Request(reqs[0].prompt_ids, 20, GREEDY, stop=(stop,))]).outputs
    assert out[0] == ref[0][:cut]
    assert_all_free(eng)


@one_arch
def test_max_new_tokens_reached_mid_run(tiny):
    reqs = requests(max_new=6)
    ref = reference(tiny.model, reqs)
    seen = []

    def script(ids):                                  # 每次都猜 10 个（全对）：引擎把它截到还能产出的数目
        guess = continuation_proposer({tuple(r.prompt_ids): o for r, o in zip(reqs, ref)}, 10).script(ids)
        seen.append(len(guess))
        return guess
    eng = spec_engine(tiny.model, FakeProposer(script))
    per_step = run_steps(eng, reqs)
    assert [sum(c, []) for c in per_step.values()] == ref
    assert all(len(c) == 2 and len(c[1]) == 5 for c in per_step.values())   # prefill 1 个，然后一步出剩下的 5 个
    assert eng.spec_stats.proposed == 4 * len(reqs)  # 每个请求只验证了 4 个猜测（第 5 个 token 是奖励）
    assert_all_free(eng)


# ---------------------------------------------------------------- plan：验证的行

@pytest.mark.parametrize("attention", ["paged", "gather"])
@one_arch
def test_plan_puts_verify_rows_in_the_flat_row_and_names_each_requests_logits_rows(tiny, attention):
    """块大小 4。d：decode（提示词 5 + 1 个输出）；v：带 2 个猜测的 decode（提示词 6 + 1 个输出，这一步算 3 个）；
    c：一个提示词的第一块（提示词 9，这次算 4 个，不采样）。行：d 在前（只算 1 个），然后 v 的 3 个、c 的 4 个；
    要 logits 的是 d 的 1 个和 v 的 3 个，logits_rows 按 seqs 的顺序告诉引擎各自在 logits 里的哪几行。"""
    from step09_speculative.kv_cache import PagedKVCache
    from step09_speculative.sequence import Sequence

    def seq_at(prompt, outputs, computed, table, spec=()):
        seq = Sequence(0, Request(prompt, 8), torch.Generator(), 0.0, block_table=table)
        seq.output_ids, seq.num_computed_tokens, seq.spec_token_ids = list(outputs), computed, list(spec)
        return seq

    v = seq_at([11, 12, 13, 14, 15, 16], [17], 6, [3, 7, 9], spec=[18, 19])
    c = seq_at(list(range(40, 49)), [], 0, [0, 1, 2])
    d = seq_at([21, 22, 23, 24, 25], [26], 5, [5, 6])
    fwd = PagedKVCache(tiny.cfg, 16, 4, "cpu", torch.float32, attention).plan([v, c, d], [3, 4, 1])
    assert fwd.input_ids.tolist() == [[26, 17, 18, 19, 40, 41, 42, 43]]
    assert fwd.positions.tolist() == [[5, 6, 7, 8, 0, 1, 2, 3]]
    assert fwd.slot_mapping.tolist() == [6 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 9 * 4 + 0, 0, 1, 2, 3]
    assert fwd.seq_lens.tolist() == [6, 9, 4] and fwd.query_lens.tolist() == [1, 3, 4]
    assert fwd.logits_index.tolist() == [1, 2, 3, 0]          # 按 seqs 的顺序：v 的 3 个，然后 d
    assert fwd.logits_rows == [range(0, 3), range(3, 3), range(3, 4)]
    assert (fwd.segments is not None) == (attention == "gather")


# ---------------------------------------------------------------- 分页的账

@one_arch
def test_rejected_tokens_roll_back_and_never_reach_the_prefix_cache(tiny):
    reqs = requests(max_new=20)
    ref = reference(tiny.model, reqs)
    truth = {tuple(r.prompt_ids): o for r, o in zip(reqs, ref)}
    eng = spec_engine(tiny.model, continuation_proposer(truth, 4, wrong_at=2))
    rids = [eng.add_request(r) for r in reqs]
    while eng.has_unfinished_requests():
        eng.step()
        for seq in eng.scheduler.running:
            if not seq.in_prefill:                   # 回滚之后：除了刚产出的最后一个 token，其余的 K/V 都在池子里
                assert seq.num_computed_tokens == seq.num_tokens - 1 and not seq.spec_token_ids
    real = [tuple(r.prompt_ids) + tuple(o) for r, o in zip(reqs, ref)]
    bs = eng.config.block_size
    for block, entry in eng.block_manager.cached.items():   # 登记过的每一块都是某个请求真正的 token（不含猜测）
        assert any(seq[i:i + bs] == entry.token_ids for seq in real for i in range(0, len(seq), bs))
    assert len(eng.block_manager.cached) > 0
    again = eng.generate([reqs[1]])                   # 再来一遍同一个请求：命中前缀缓存，输出不变
    assert again.outputs == [ref[1]] and again.stats.cached_tokens[0] > 0
    assert_all_free(eng)
    del rids


@one_arch
@pytest.mark.parametrize("preempt, attention", [("recompute", "paged"), ("swap", "paged"), ("recompute", "gather")])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_small_pool_with_preemption(tiny, preempt, attention, method):
    reqs = requests(max_new=30)
    cfg = dict(num_blocks=24, block_size=4, max_batch_size=5, preempt=preempt, attention=attention)
    ref = reference(tiny.model, reqs, **cfg)
    eng = spec_engine(tiny.model, spec_method=method, num_spec_tokens=3, ngram_min=1, draft=tiny.model, **cfg)
    out = eng.generate(reqs)
    assert out.outputs == reference(tiny.model, reqs)
    assert out.outputs == ref
    assert out.stats.preemptions > 0 and eng.spec_stats.accepted > 0
    assert_all_free(eng)


@one_arch
@pytest.mark.parametrize("step", [step09, step10], ids=["step09", "step10"])
@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_preemption_frees_the_draft_state(tiny, preempt, step):
    """Proposer.free 在抢占时也被调用（不只是结束、abort）：每一步之后，草稿模型只为运行集合里的请求存着状态和块；
    被抢占的请求回来以后草稿重新追上它。输出仍与 step08 相同。"""
    reqs = requests(max_new=30)
    cfg = dict(num_blocks=24, block_size=4, max_batch_size=5, preempt=preempt)
    eng = spec_engine(tiny.model, spec_method="draft", num_spec_tokens=3, draft=tiny.model, step=step, **cfg)
    seqs = [eng.seqs[eng.add_request(r)] for r in reqs]
    while eng.has_unfinished_requests():
        eng.step()
        assert set(eng.proposer.states) <= {seq.request_id for seq in eng.scheduler.running}
        held = sum(len(st.block_table) for st in eng.proposer.states.values())
        assert eng.proposer.block_manager.num_free_blocks == eng.proposer.block_manager.num_blocks - held
    assert [seq.output_ids for seq in seqs] == reference(tiny.model, reqs, **cfg)
    assert sum(seq.num_preemptions for seq in seqs) > 0
    assert_all_free(eng)


def spy_draft_forwards(eng) -> list[int]:
    """草稿模型的每一次前向算了几个 token（换上一个记账的包装）。"""
    calls, draft = [], eng.proposer.model

    class Spy(torch.nn.Module):
        cfg = draft.cfg

        def forward(self, input_ids, *args, **kw):
            calls.append(input_ids.numel())
            return draft(input_ids, *args, **kw)
    eng.proposer.model = Spy()
    return calls


def spy_proposals(eng) -> list[tuple[int, list[tuple[int, int]]]]:
    """每次要猜测时：(这一步 decode 的请求数, [(猜了几个, 这个请求留得下几个 = max_new_tokens 还剩的减 1)])。"""
    log, propose = [], eng.proposer.propose

    def spy(seqs, *args):
        n_decode = sum(not s.in_prefill for s in eng.scheduler.running)
        out = propose(seqs, *args)
        log.append((n_decode, [(len(p.token_ids), s.request.max_new_tokens - len(s.output_ids) - 1)
                               for s, p in zip(seqs, out)]))
        return out
    eng.proposer.propose = spy
    return log


@one_arch
@pytest.mark.parametrize("step", [step09, step10], ids=["step09", "step10"])
def test_draft_forwards_respect_the_token_budget(tiny, other_tiny, step):
    """草稿模型第一次见到一个请求时要把整段提示词算进它的池子：这次前向也守 max_num_batched_tokens（分几步追上，
    追上之前不猜），与目标的分块 prefill 一样，不会有一次超过预算的长前向让所有请求干等。"""
    reqs = requests()                                  # 提示词 5、17、33、8、12 个 token
    cfg = dict(max_batch_size=5, max_num_batched_tokens=8)
    eng = spec_engine(tiny.model, spec_method="draft", num_spec_tokens=3, draft=other_tiny, step=step, **cfg)
    calls = spy_draft_forwards(eng)
    out = eng.generate(reqs)
    assert out.outputs == reference(tiny.model, reqs, **cfg)
    assert calls and max(calls) <= 8
    assert max(st.tokens for st in out.stats.steps) <= 8
    assert eng.spec_stats.proposed > 0
    assert_all_free(eng)


@one_arch
@pytest.mark.parametrize("step", [step09, step10], ids=["step09", "step10"])
def test_draft_drafts_only_what_can_be_kept(tiny, step):
    """还剩 2 个 token 要生成时至多留得下 1 个猜测：草稿只走 1 步，不走 k 步再被截掉。"""
    eng = spec_engine(tiny.model, spec_method="draft", num_spec_tokens=4, draft=tiny.model, step=step)
    calls = spy_draft_forwards(eng)
    log = spy_proposals(eng)
    out = eng.generate([Request(prompts()[0], 3, GREEDY, ignore_eos=True)])   # prefill 出 1 个，还剩 2 个
    assert out.outputs == reference(tiny.model, [Request(prompts()[0], 3, GREEDY, ignore_eos=True)])
    assert [props for _, props in log] == [[(1, 1)]] and len(calls) == 1      # 猜 1 个（全对）+ 奖励 token：结束
    assert out.stats.num_forwards == 2


@one_arch
@pytest.mark.parametrize("step", [step09, step10], ids=["step09", "step10"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_proposals_fit_max_new_tokens_and_the_token_budget(tiny, method, step):
    """每次要的猜测：每个请求不超过 max_new_tokens 还剩的减 1；一步里全部猜测不超过预算减去 decode 请求数
    （调度器先给每个 decode 1 个 token，再给猜测）。5 个 2 个 token 的提示词一步全部 prefill 完，之后 5 个一起 decode：
    预算 10 里只有 5 个留给猜测。"""
    reqs = requests(max_new=12, ps=[[5 + i, 6] for i in range(5)])
    cfg = dict(max_batch_size=5, max_num_batched_tokens=10)
    eng = spec_engine(tiny.model, spec_method=method, num_spec_tokens=4, ngram_min=1, draft=tiny.model, step=step,
                      **cfg)
    log = spy_proposals(eng)
    out = eng.generate(reqs)
    assert out.outputs == reference(tiny.model, reqs, **cfg)
    assert log[0][0] == 5 and all(n <= keep for _, props in log for n, keep in props)
    assert all(sum(n for n, _ in props) <= 10 - n_decode for n_decode, props in log)
    assert any(n > 0 for _, props in log for n, _ in props)
    assert_all_free(eng)


@one_arch
def test_chunked_prefill_budget_trims_proposals(tiny):
    reqs = requests()
    eng = spec_engine(tiny.model, spec_method="ngram", num_spec_tokens=4, ngram_min=1, max_batch_size=5,
                      max_num_batched_tokens=7)
    out = eng.generate(reqs)
    assert out.outputs == reference(tiny.model, reqs)
    assert max(st.tokens for st in out.stats.steps) <= 7
    assert_all_free(eng)


@one_arch
def test_abort_frees_the_draft_pool_too(tiny):
    eng = spec_engine(tiny.model, spec_method="draft", num_spec_tokens=3, draft=tiny.model)
    rids = [eng.add_request(r) for r in requests()]
    for _ in range(3):
        eng.step()
    assert eng.proposer.states
    for rid in rids:
        eng.abort(rid)
    assert all(o.finish_reason == "abort" for o in eng.step())
    assert_all_free(eng)


@one_arch
def test_low_acceptance_pauses_speculation(tiny):
    reqs = requests(max_new=40)[:1]
    ref = reference(tiny.model, reqs)
    wrong = continuation_proposer({tuple(reqs[0].prompt_ids): ref[0]}, 3, wrong_at=0)   # 永远第一个就猜错
    eng = spec_engine(tiny.model, wrong)
    assert eng.generate(reqs).outputs == ref
    # 前 SPEC_WINDOW 次全被拒 → 暂停 SPEC_PAUSE_STEPS 步 → 再试 SPEC_WINDOW 次 → ...；39 个 decode 步
    cycle = SPEC_WINDOW + SPEC_PAUSE_STEPS
    assert eng.spec_stats.verifications == sum(min(SPEC_WINDOW, 39 - start) for start in range(0, 39, cycle))
    assert eng.spec_stats.accepted == 0


def test_config_errors(tiny):
    for bad in (dict(spec_method="eagle"), dict(spec_method="ngram", num_spec_tokens=0),
                dict(spec_method="ngram", ngram_min=3, ngram_max=2), dict(spec_method="ngram", ngram_min=0)):
        with pytest.raises(UserError):
            spec_engine(tiny.model, **bad)
    with pytest.raises(UserError, match="--draft-model"):
        spec_engine(tiny.model, spec_method="draft")


@one_arch
def test_draft_vocabulary_must_match(tiny, tmp_path):
    small = load_model(make_tiny_model_dir(tmp_path, "llama", vocab_size=128), "cpu", torch.float32)
    with pytest.raises(UserError, match="vocabulary"):
        spec_engine(tiny.model, spec_method="draft", draft=small)


# ---------------------------------------------------------------- 抽样：分布上精确

V = 8                               # 小词表：两个 token 的联合分布只有 64 格
DIST_PROMPT = [1, 2, 3, 1, 2, 4, 5, 1, 2, 6]
DIST_PARAMS = SamplingParams(temperature=0.3, top_p=0.9, repetition_penalty=1.3)
DRAWS = 2000


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    target = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("v8"), "llama", vocab_size=V, seed=2),
                        "cpu", torch.float32)
    draft = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("v8d"), "llama", vocab_size=V, seed=3),
                       "cpu", torch.float32)
    return target, draft


def theory_t2_t3(model) -> torch.Tensor:
    """直接抽样时第 2、3 个输出 token 的理论联合分布 (V·V,)：对第 1 个 token 求和，条件分布用 HF 的处理器算。"""
    def next_probs(ids):
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
        return hf_filtered_probs(logits, ids, [], DIST_PARAMS).double()
    out = torch.zeros(V * V, dtype=torch.float64)
    with torch.inference_mode():
        p1 = next_probs(DIST_PROMPT)
        for t1 in range(V):
            if p1[t1] == 0:
                continue
            p2 = next_probs(DIST_PROMPT + [t1])
            for t2 in range(V):
                if p2[t2] > 0:
                    out[t2 * V:(t2 + 1) * V] += p1[t1] * p2[t2] * next_probs(DIST_PROMPT + [t1, t2])
    return out


def engine_t2_t3(target, method: str, draft=None) -> tuple[torch.Tensor, SpecStats]:
    """DRAWS 个请求（种子 0..DRAWS-1），各生成 3 个 token；第 1 个由 prefill 抽出，第 2 个验证 1 个猜测
    （接受或更正），第 3 个是奖励 token 或下一步照常抽的：数 (第 2, 第 3) 个 token 的经验分布。"""
    cfg = EngineConfig(num_blocks=2048, block_size=4, max_batch_size=256, max_num_batched_tokens=4096,
                       spec_method=method, num_spec_tokens=1, ngram_min=1)
    eng = LLMEngine(target, cfg, draft_model=draft)
    reqs = [Request(DIST_PROMPT, 3, SamplingParams(**{**DIST_PARAMS.__dict__, "seed": i}), ignore_eos=True)
            for i in range(DRAWS)]
    outs = eng.generate(reqs).outputs
    counts = torch.bincount(torch.tensor([o[1] * V + o[2] for o in outs]), minlength=V * V).double()
    return counts / DRAWS, eng.spec_stats


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_engine_sampling_is_exact_in_distribution(vocab8, method, monkeypatch):
    target, draft = vocab8
    theory = theory_t2_t3(target)
    bound = tv_bound(theory, DRAWS)
    emp, st = engine_t2_t3(target, method, draft)
    assert st.verifications > DRAWS // 2 and 0 < st.accepted < st.proposed   # 接受和拒绝都发生了很多次
    assert tv_distance(emp, theory) < bound, (tv_distance(emp, theory), bound)
    if method == "draft":
        return                                        # 规则改坏的那一半只跑一种（慢；抽样器本身的测试两种都跑）
    # 同一个检查，规则改坏（总是接受）就失败
    monkeypatch.setattr(rejection_sampler, "accepts", lambda u, p_d, q_d: True)
    broken, _ = engine_t2_t3(target, method, draft)
    assert tv_distance(broken, theory) > bound, (tv_distance(broken, theory), bound)


# ---------------------------------------------------------------- run.py（生成模式，进程内）

def run_generation(module, argv, capsys) -> dict:
    from common import cli
    with pytest.raises(SystemExit) as e:
        cli.run_main(module.make_parser(), module.main, argv)
    captured = capsys.readouterr()
    assert e.value.code == 0, captured.err[-2000:]
    return json.loads(captured.out.strip().splitlines()[-1])


def test_run_py_every_method_equals_step08(tiny_tok_dir, capsys):
    """同样的提示词：step08 的 run.py 与 step09 的 run.py（none / ngram / 自己当草稿）给出同样的 token。"""
    from step08_kv_quant import run as run08
    from step09_speculative import run as run09
    argv = ["--model", str(tiny_tok_dir), "--prompt", "hello hello hello hello", "--prompt", "a b c a b c a b",
            "--max-new-tokens", "12", "--ignore-eos", "--json"]
    ref = [x["output_ids"] for x in run_generation(run08, argv, capsys)["results"]]
    for extra in (["--spec-method", "none"], [], ["--draft-model", str(tiny_tok_dir), "--num-spec-tokens", "3"]):
        out = run_generation(run09, argv + extra, capsys)
        assert [x["output_ids"] for x in out["results"]] == ref, extra
    assert out["stats"]["spec_method"] == "draft"
    assert out["stats"]["accepted"] == out["stats"]["proposed"] > 0      # 自己当草稿：全部接受


def test_run_py_errors(tiny_tok_dir, capsys):
    from step09_speculative import run as run09
    base = ["--model", str(tiny_tok_dir), "--prompt", "hi"]
    assert "--draft-model" in cli_error(run09, base + ["--spec-method", "draft"], capsys)
    assert "--spec-method" in cli_error(run09, base + ["--spec-method", "eagle"], capsys)
    assert "--ngram-min" in cli_error(run09, base + ["--ngram-min", "5", "--ngram-max", "2"], capsys)
    assert "--num-spec-tokens" in cli_error(run09, base + ["--num-spec-tokens", "0"], capsys)
    assert "step09" in cli_error(run09, base + ["--no-chunked-prefill", "--spec-method", "ngram"], capsys)
    assert "only used with" in cli_error(run09, base + ["--draft-model", str(tiny_tok_dir), "--spec-method", "none"],
                                         capsys)
    assert "does not exist" in cli_error(run09, base + ["--draft-model", "/nonexistent/dir"], capsys)


@one_arch
@pytest.mark.parametrize("step", [step09, step10], ids=["step09", "step10"])
def test_a_failing_proposal_ends_only_its_request(tiny, step):
    """一个请求的猜测抛出（提议者是一批一起猜的）：只有它以 "error" 结束、块还回去，同一批别的请求照常猜、
    输出与 step08 逐 token 相同；generate() 把这个错误抛给调用者。"""
    model = tiny.model
    reqs = requests()
    truth = {tuple(r.prompt_ids): out for r, out in zip(reqs, reference(model, reqs))}
    good = continuation_proposer(truth, 3).script
    bad_prompt = tuple(reqs[1].prompt_ids)

    def script(token_ids):
        if tuple(token_ids[:len(bad_prompt)]) == bad_prompt and len(token_ids) > len(bad_prompt) + 2:
            raise RuntimeError("injected proposal failure")
        return good(token_ids)
    engine = spec_engine(model, FakeProposer(script), step=step, num_spec_tokens=3)
    ids = [engine.add_request(r) for r in reqs]
    outs, errors = {i: [] for i in ids}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] += o.new_token_ids
            if o.finish_reason == "error":
                errors[o.request_id] = o.error
    assert list(errors) == [ids[1]] and "injected proposal failure" in str(errors[ids[1]])
    assert [outs[i] for i in ids if i != ids[1]] == [truth[tuple(r.prompt_ids)] for r in reqs if r is not reqs[1]]
    assert engine.spec_stats.accepted > 0                 # 别的请求确实还在猜
    assert_all_free(engine)
    with pytest.raises(RuntimeError, match="injected proposal failure"):
        spec_engine(model, FakeProposer(script), step=step, num_spec_tokens=3).generate(reqs)
