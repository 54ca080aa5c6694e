"""bench/step_overhead.py（只测量；这里测它的读数是完整的、互相对得上，不计时）：--quick --json 在带真实分词器的
随机小模型上跑完一遍——step03 的前向、step09 的 engine.step()（主线程与专用线程）、经过服务器的流式请求
（客户端是另一个进程，再一遍是本进程的线程；对照的命令行服务器是另一个进程）、第 07 章的 --quick 负载。"""
import json
import math

import torch

from bench import step_overhead as P


def test_quick_json_is_complete_and_consistent(tiny_tok_dir, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")           # 客户端子进程
    assert P.main(["--quick", "--json", "--model", str(tiny_tok_dir)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["context"], out["tokens"], out["server_engine"]) == (64, 16, "step09")
    assert out["bare_forward_s"] > 0 and len(out["load_avg"]) == 2
    for where in ("engine_step", "engine_step_in_thread"):
        r = out[where]["step09"]
        assert r["forward"] > 0 and r["total"] >= r["forward"]
        assert set(r) == {"total", "thread_cpu", *P.ENGINE_PHASES}
    for name in ("step03", "step09"):                     # 钩子真的挂上了：线性层与注意力都量到了
        f = out["forward_split"][name]
        assert f["matmul"] > 0 and f["attention"] > 0 and f["forward"] > f["matmul"]
    # 引擎与服务器给出的贪心 token 与 step03 相同：拆分量的是同一件事
    assert out["tokens_equal_step03"] == {"step09": True}
    assert out["served_tokens_equal_step03"] == {"direct": True, "process": True, "thread": True, "cli_server": True}
    assert 0 < out["server_engine_direct"]["forward"] <= out["server_engine_direct"]["engine_step"]
    assert out["cli_server_itl_s"] > 0
    assert out["torch_threads"]["main"] == torch.get_num_threads()
    for where in ("process", "thread"):
        srv = out["server"][where]
        assert srv["tokens"] == 16
        assert all(srv[k] >= 0 for k in P.LOOP_PARTS)
        # 循环一圈 = 这几段首尾相接（各自取中位数，所以只要求同一量级）
        assert 0.5 * srv["cycle"] <= sum(srv[k] for k in P.LOOP_PARTS) <= 2 * srv["cycle"]
    ch = out["chapter07"]
    assert ch["requests"] == 10 and ch["tpot_p50"] > 0
    assert math.isclose(sum(ch["split"].values()), ch["weighted_step"])
    assert math.isclose(sum(k["share"] for k in ch["kinds"].values()), 1.0)
    assert all(k["steps"] > 0 for k in ch["kinds"].values())
