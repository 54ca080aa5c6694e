"""step12 章节模式的测量工具：长文本取 token、passkey 提示词、NLL 的分段平均、"压缩之后才问"的核对、与 full 的一致率。
只用分词器与手写的数，不跑模型（章节模式整体在 test_run_chapter_mode.py 里跑）。"""
import pytest

from common.tokenizer import Tokenizer
from step12_kv_eviction.analysis.runs import Run, Setting, agreement, mean_nll, parse, pool_blocks
from step12_kv_eviction.analysis.measure import asked_after_compaction, ktok
from step12_kv_eviction.analysis.texts import (NEEDLE, QUESTION, encode, long_text_ids, moving_average, passkey,
                                               passkey_set, windowed_means)
from step09_speculative.sequence import Logprob


@pytest.fixture(scope="module")
def tok(tiny_tok_dir):
    return Tokenizer(tiny_tok_dir)


def test_long_text_gives_n_tokens_deterministically(tok):
    a, b = long_text_ids(tok, 3000), long_text_ids(tok, 3000)
    assert len(a) == 3000 and a == b
    assert long_text_ids(tok, 300) == a[:300]          # 前缀分词与整段分词的前 n 个相同
    assert tok.decode(a[:8]).startswith('The "assert" statement')


@pytest.mark.parametrize("n, depth", [(1024, 0.1), (1024, 0.5), (2048, 0.9), (512, 0.0), (512, 1.0)])
def test_passkey_puts_the_key_at_the_asked_depth(tok, n, depth):
    pk = passkey(tok, n, depth, seed=7)
    needle = encode(tok, NEEDLE.format(key=pk.key))
    q = encode(tok, QUESTION)
    assert pk.context_len == n and len(pk.ids) == n + len(q) and pk.ids[n:] == q
    starts = [i for i in range(n) if pk.ids[i:i + len(needle)] == needle]
    assert len(starts) == 1                                        # 藏了一次，整句都在上下文里
    assert starts[0] / n == pytest.approx(pk.depth)
    unit = len(encode(tok, " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."))
    head = len(encode(tok, "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                      "I will quiz you about the important information there."))
    # 离要求的深度（在无关文字里量）最多半个无关句子；深度 1 时放在最后一个整句之后
    room = n - head - len(needle)
    assert abs((starts[0] - head) - depth * room) <= unit / 2 + (unit if depth == 1.0 else 0)
    assert pk.correct(f" {pk.key}. Remember") and not pk.correct(" 12345") and not pk.correct("no digits")


def test_passkey_set_aligns_question_for_both_ways_of_asking(tok):
    q = len(encode(tok, QUESTION))
    after = passkey_set(tok, [512, 1024], [0.1, 0.9], asked_after=True)
    inside = passkey_set(tok, [512, 1024], [0.1, 0.9], asked_after=False)
    assert [p.context_len for p in after] == [512, 512, 1024, 1024]          # 上下文恰好结束在块边界，问题之后单独一块
    assert [len(p.ids) for p in inside] == [512, 512, 1024, 1024]             # 整个提示词是块的整数倍，问题收在最后一块末尾
    assert [p.key for p in after] == [p.key for p in inside]                  # 同一格同一个数
    assert len({p.key for p in after}) == 4 and all(p.question_len == q for p in after)


def test_windowed_means_and_moving_average():
    vals = [1.0, 3.0, 5.0, 7.0, 9.0]
    assert windowed_means(vals, 1, 2) == [(1, 3, 2.0), (3, 5, 6.0), (5, 6, 9.0)]
    assert moving_average(vals, 2) == [1.0, 2.0, 4.0, 6.0, 8.0]
    assert moving_average(vals, 10) == [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("label", ["full", "window_512", "sinks4_512_cachepos", "sinks4_512_textpos", "sinks2_64_cachepos",
                                   "h2o_512", "snapkv_2048", "snapkv-chunked_512", "window_256_textpos",
                                   "h2o_128_cachepos"])
def test_setting_label_round_trip(label):
    st = parse(label)
    assert st.label == label
    cfg = st.config()
    assert cfg["kv_policy"] == st.policy and cfg.get("kv_budget") == st.budget
    assert ("num_sinks" in cfg) == (st.policy == "sinks")


def test_pool_blocks_cover_budget_slack_and_one_forward():
    assert pool_blocks(Setting(), 1000, 256, 16) == 63 + 1
    assert pool_blocks(Setting("sinks", 512), 10**6, 256, 16) == -(-(512 + 15 + 256) // 16) + 1
    assert pool_blocks(Setting("snapkv-chunked", 512), 10**6, 256, 16, new_tokens=40) == -(-(512 + 15 + 256 + 40) // 16) + 1
    # snapkv 在 prefill 时留着整个提示词（2,000），压缩之后 512 + 40
    assert pool_blocks(Setting("snapkv", 512), 2040, 256, 16, new_tokens=40) == -(-2000 // 16) + 1
    assert pool_blocks(Setting("snapkv", 512), 700, 256, 16, new_tokens=100) == -(-(512 + 100) // 16) + 1   # 压缩之后更多
    assert pool_blocks(Setting("h2o", 512), 100, 256, 16) == 7 + 1                 # 短请求：不超过它自己的 token


def test_asked_after_compaction_reads_the_trace():
    # (已算的 token, 块, 被驱逐的)：上下文 768 = 3 块 256，问题 11 个，然后 decode
    good = [(256, 16, 0), (512, 33, 0), (768, 33, 240), (779, 33, 240), (780, 33, 240)]
    assert asked_after_compaction(good, 768, 11)
    assert not asked_after_compaction([(256, 16, 0), (512, 33, 0), (768, 49, 0), (779, 49, 0)], 768, 11)   # 上下文末尾没压缩
    assert not asked_after_compaction([(256, 16, 0), (512, 33, 0), (768, 33, 240), (779, 33, 251)], 768, 11)  # 问题那一块又压缩了
    assert not asked_after_compaction([(256, 16, 0), (600, 33, 80), (779, 33, 240)], 768, 11)            # 块没对齐
    assert not asked_after_compaction([(256, 16, 0), (512, 33, 0), (768, 33, 240)], 768, 11)             # 没有问题那一次前向


def lp(token, logprob):
    return Logprob(token, logprob, [(token, logprob)])


def test_agreement_and_mean_nll_use_positions_lo_to_hi():
    ref = Run(prompt_logprobs=[None, lp(1, -1.0), lp(2, -2.0), lp(3, -3.0), lp(4, -4.0)])
    got = Run(prompt_logprobs=[None, lp(1, -1.5), lp(9, -2.0), lp(3, -3.5), lp(8, -5.0)])
    assert ref.nll == [1.0, 2.0, 3.0, 4.0]
    a, d = agreement(ref, got, 2, 5)                       # 位置 2、3、4
    assert a == pytest.approx(1 / 3) and d == pytest.approx((0.0 + 0.5 + 1.0) / 3)
    assert mean_nll(ref, 1, 3) == pytest.approx(1.5)


def test_ktok():
    assert ktok(16384) == "16k" and ktok(8192) == "8k" and ktok(1024) == "1k" and ktok(1536) == "1.5k"
