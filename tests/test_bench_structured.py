"""bench/structured_bench.py（只测量；这里测它的读数是完整的、互相对得上，不计时）：--quick --json 在带真实分词器的
随机小模型上跑完一遍——每个语法三家都编译了（我们的状态数与我们的 DFA 相同）、沿路径每一步都量了、批 1 / 批 8 的
掩码占比在 0 与 1 之间、token/s 的三种运行都产出了 token，跳与不跳的关系（chapter.jump_relation）在每个提示词上成立
（它与模型无关：随机权重也一样）、强制的 token 只在跳的那次出现。"""
import json

from bench import structured_bench as B
from step15_structured_output.automaton import compile_regex


def test_quick_json_is_complete_and_consistent(tiny_tok_dir, capsys):
    assert B.main(["--quick", "--json", "--model", str(tiny_tok_dir)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["quick"] and out["repeats"] == 1 and len(out["load_avg"]) == 2 and "load average" in out["uptime"][0]
    names = [g[0] for g in B.GRAMMARS]
    assert list(out["compile"]) == names == list(out["mask_per_token"])
    for name, kind, g, _ in B.GRAMMARS:
        c = out["compile"][name]
        assert c["states"] == compile_regex(B.our_regex(kind, g)).num_states
        assert c["ours_s"] > 0 and c["xgrammar_s"] > 0
        assert ("outlines_s" in c) == (name not in B.BIG) == ("ours_all_states_s" in c)
        m = out["mask_per_token"][name]
        assert m["tokens"] > 1 and m["ours_first_us"]["max"] >= m["ours_first_us"]["median"] > 0
    assert set(out["apply"]) == {"1", "8"}
    for b in ("1", "8"):
        for k in ("cold", "warm"):
            r = out["engine_mask_share"][b][k]
            assert r["steps"] > 0 and 0 < r["share"] < 1 and r["step_ms"] > r["mask_ms"] > 0
    assert set(out["speed"]) == {"long_keys_batch8", "long_keys_batch1"}
    for r in out["speed"].values():
        assert r["relation_ok"] == r["prompts"] >= r["same_tokens"]
        assert r["free"]["jump_tokens"] == r["no_jump"]["jump_tokens"] == 0 < r["jump"]["jump_tokens"]
        assert r["jump"]["forwards"] < r["no_jump"]["forwards"]
        assert all(r[k]["tokens"] > 0 and r[k]["tok_s"] > 0 for k in ("free", "no_jump", "jump"))
