"""bench/step_overhead.py（只测量；这里测它的读数是完整的、互相对得上，不计时）与 common/openmp.py：

- --quick --json 在带真实分词器的随机小模型上跑完一遍：step03 的前向、step09 的 engine.step()（三种线程状态）、
  经过服务器的流式请求（两种状态 × 客户端是另一个进程 / 本进程的线程；对照的命令行服务器是另一个进程）、
  第 07 章的 --quick 负载；
- release_thread_pool() 真的还掉调用它的线程的 OpenMP 线程池（池里的工作线程退出），别的线程的池不动。
"""
import json
import math
import subprocess
import sys

import pytest
import torch

from bench import step_overhead as P
from conftest import ROOT


def test_quick_json_is_complete_and_consistent(tiny_tok_dir, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")           # 客户端与命令行服务器的子进程
    assert P.main(["--quick", "--json", "--model", str(tiny_tok_dir)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["context"], out["tokens"], out["server_engine"]) == (64, 16, "step09")
    assert out["bare_forward_s"] > 0 and len(out["load_avg"]) == 2
    assert set(out["engine_step"]) == set(P.OFFLINE_MODES)
    for mode, by in out["engine_step"].items():
        r = by["step09"]
        assert r["forward"] > 0 and r["total"] >= r["forward"]
        assert set(r) == {"total", "thread_cpu", "switches", *P.ENGINE_PHASES}
        assert r["switches"] >= 0
    for name in ("step03", "step09"):                     # 钩子真的挂上了：线性层与注意力都量到了
        f = out["forward_split"][name]
        assert f["matmul"] > 0 and f["attention"] > 0 and f["forward"] > f["matmul"]
    # 引擎与服务器给出的贪心 token 与 step03 相同：拆分量的是同一件事
    assert out["tokens_equal_step03"] == {"step09": True}
    assert out["served_tokens_equal_step03"] == {"direct": True, "process": True, "thread": True, "cli_server": True}
    assert out["torch_threads"]["main"] == torch.get_num_threads()
    assert set(out["server"]) == set(P.SERVER_MODES)
    for by in out["server"].values():
        assert 0 < by["direct"]["forward"] <= by["direct"]["engine_step"]
        for where in ("process", "thread"):
            srv = by[where]
            assert srv["tokens"] == 16
            assert all(srv[k] >= 0 for k in P.LOOP_PARTS)
            # 循环一圈 = 这几段首尾相接（各自取中位数，所以只要求同一量级）
            assert 0.5 * srv["cycle"] <= sum(srv[k] for k in P.LOOP_PARTS) <= 2 * srv["cycle"]
    assert out["cli_server"]["itl"] > 0 and out["cli_server"]["threads"] > 1
    ch = out["chapter07"]
    assert ch["requests"] == 10 and ch["tpot_p50"] > 0
    assert math.isclose(sum(ch["split"].values()), ch["weighted_step"])
    assert math.isclose(sum(k["share"] for k in ch["kinds"].values()), 1.0)
    assert all(k["steps"] > 0 for k in ch["kinds"].values())


RELEASE = """
import os, sys, threading
sys.path.insert(0, sys.argv[1])
import torch
from common.openmp import _libgomp, release_thread_pool
torch.set_num_threads(2)
if _libgomp() is None:
    print("no-libgomp")
    sys.exit(0)
def threads():
    return len(os.listdir("/proc/self/task"))
def parallel_op():
    torch.ones(1 << 22).sum()                       # 够大：两个线程分着算，调用它的线程建起自己的池
n0 = threads()
parallel_op()
n1 = threads()                                      # 主线程的池：多一个工作线程
go, ready = threading.Event(), threading.Event()
def engine_thread():
    parallel_op()
    ready.set()
    go.wait()
t = threading.Thread(target=engine_thread)
t.start()
ready.wait()
n2 = threads()                                      # 那个线程自己 + 它的池里的一个工作线程
ok = release_thread_pool()
n3 = threads()                                      # 主线程的工作线程退出了；另一个线程的池还在
again = release_thread_pool()                       # 没有池了：什么也不做
n4 = threads()
parallel_op()
n5 = threads()                                      # 主线程再跑并行算子：池又建起来
go.set()
t.join()
print(ok, again, n1 - n0, n2 - n1, n3 - n2, n4 - n3, n5 - n4)
"""


def test_release_thread_pool_releases_only_the_callers_pool():
    """在一个干净的子进程里（测试进程自己的 OpenMP 状态由 pytest-xdist 定成 1 个线程，没有池可还）：主线程跑过并行算子，
    另一个线程也跑过、还活着；主线程调用 release_thread_pool() 后，进程少了一个线程（主线程池里的那个工作线程），
    另一个线程的池不动；再调用一次什么也不少；主线程再跑并行算子，池重新建起来。"""
    out = subprocess.run([sys.executable, "-c", RELEASE, str(ROOT)], capture_output=True, text=True, timeout=120,
                         env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-libgomp":
        pytest.skip("this torch does not use GNU libgomp: nothing to release")
    ok, again, *deltas = out.stdout.split()
    assert (ok, again) == ("True", "True")
    assert [int(d) for d in deltas] == [1, 2, -1, 0, 1]
