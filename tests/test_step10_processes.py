"""step10：多进程出错与收尾（某个 worker 抛错或被 kill -9 时整组停下，rank 0 报出原因，进程全部退出），run.py 在
Ctrl-C、rank 0 被 kill -9 时一个进程都不留下，以及两个 torchrun "节点"跑流水线。

这个文件在顶层只 import 轻的模块：exploding_worker 要在 worker 进程里按模块名重新 import 这个文件
（conftest 会带进 transformers，多花几秒）。
"""
import datetime
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common.errors import UserError
from common.weights import load_model
from step10_tensor_parallel import parallel_layers
from step10_tensor_parallel.distributed import WorkerFailed, launch, serve_worker
from step10_tensor_parallel.engine import EngineConfig, LLMEngine
from step10_tensor_parallel.parallel_layers import load_shard
from step04_static_batching.request import Request

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = str(ROOT / "step10_tensor_parallel" / "run.py")
TEST_TIMEOUT = datetime.timedelta(seconds=60)   # 挂住的通信最多等这么久就抛错，测试不会一直挂着


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import make_tiny_model_dir   # 只在测试进程里 import（见文件开头）
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp_fail"), "llama")


def exploding_worker(parallel, model_dir, bad_rank: int, at_forward: int):
    """serve_worker，只是 bad_rank 在第 at_forward 次前向时抛错（0 = 装模型之前就抛）。"""
    if parallel.rank == bad_rank and at_forward == 0:
        raise ValueError("boom before loading")
    forward, calls = parallel_layers.ParallelTransformer.forward, [0]

    def exploding(self, *args, **kwargs):
        calls[0] += 1
        if parallel.rank == bad_rank and calls[0] == at_forward:
            raise ValueError(f"boom in forward {at_forward}")
        return forward(self, *args, **kwargs)
    parallel_layers.ParallelTransformer.forward = exploding   # 只改这个 worker 进程里的类
    serve_worker(parallel, model_dir, "cpu", torch.float32)


@pytest.mark.parametrize("tp, pp, bad_rank, at_forward", [(2, 2, 3, 2), (2, 1, 1, 0)],
                         ids=["mid-step-in-the-last-stage", "before-loading"])
def test_a_worker_that_raises_brings_the_whole_group_down(model_dir, tp, pp, bad_rank, at_forward):
    """rank 3（最后一个 stage 的第二个 TP rank）在第 2 次前向里抛错：rank 2 的 all-reduce 断开，rank 0 等 logits 的
    recv 断开；rank 0 报出的是原因（rank 3 的那一行），不是后果。rank 1 装模型之前就抛错：rank 0 发引擎配置时断开。
    两种情况下进程全部退出、进程组拆掉，错误是一行（UserError：run.py 打印成 `error: ...`，退出码 2）。"""
    requests = [Request([3, 4, 5, 6, 7] * i, 6) for i in range(1, 4)]
    with pytest.raises(WorkerFailed, match=f"rank {bad_rank}: ValueError: boom") as e:
        with launch(tp, pp, exploding_worker, (model_dir, bad_rank, at_forward), threads=1,
                    timeout=TEST_TIMEOUT) as par:
            engine = LLMEngine(load_shard(model_dir, par, "cpu", torch.float32), EngineConfig(32, 4, 4, 16),
                               parallel=par)
            engine.generate(requests)
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert not dist.is_initialized() and not multiprocessing.active_children()


# ---------- 命令行（子进程）----------

def start_run_py(args) -> subprocess.Popen:
    """在新的进程组里起 run.py（像终端里一样：Ctrl-C 发给整个组）。"""
    return subprocess.Popen([sys.executable, RUN_PY, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def group_pids(pgid: int) -> dict[int, int]:
    """进程组 pgid 里还活着的进程：pid → 父进程 pid（读 /proc）。"""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out[int(d)] = int(fields[1])
    return out


def wait_for_worker(proc: subprocess.Popen, timeout: float = 60) -> int:
    """等到 rank 0 的孙进程（forkserver 起的 worker）出现，返回它的 pid。"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = group_pids(proc.pid)
        workers = [p for p, parent in pids.items() if parent in pids and parent != proc.pid]
        if workers:
            return workers[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("no worker process appeared")


def assert_group_gone(pgid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while group_pids(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_pids(pgid), f"processes left behind: {group_pids(pgid)}"


def test_a_worker_killed_by_a_signal_is_reported_and_the_rest_cleaned_up(model_dir):
    """一个 worker 被 kill -9（例如被 OOM killer）：它来不及报告任何事；rank 0 的下一次通信断开，报出是哪个 rank、
    退出码多少；其余进程全部退出。"""
    with pytest.raises(WorkerFailed, match="rank 1 exited with code -9"):
        with launch(2, 1, serve_worker, (model_dir, "cpu", torch.float32), threads=1, timeout=TEST_TIMEOUT) as par:
            model = load_shard(model_dir, par, "cpu", torch.float32)
            (worker,) = multiprocessing.active_children()
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
            LLMEngine(model, EngineConfig(32, 4, 4, 16), parallel=par).generate([Request([3, 4, 5], 4)])
    assert not dist.is_initialized() and not multiprocessing.active_children()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to find the worker processes")
@pytest.mark.parametrize("how", ["Ctrl-C"])   # "kill -9 rank 0" 也在这里跑得通（worker 的看门狗），为了测试时间不默认跑
def test_run_py_leaves_no_process_behind(tiny_tok_dir, how):
    """run.py --tp 2 生成到一半：按 Ctrl-C（SIGINT 发给整个进程组，像终端那样；worker 不理它，由 rank 0 收尾）→
    一行 `error: interrupted`、退出码 130（与每一步的 run.py 相同）；rank 0 被 kill -9（来不及收尾）→ worker 的
    看门狗发现父进程没了，自己退出。进程组里都不留下任何进程（rank 0、forkserver、worker）。"""
    proc = start_run_py(["--model", str(tiny_tok_dir), "--prompt", "Hello", "--max-new-tokens", "1500", "--ignore-eos",
                         "--tp", "2"])
    try:
        wait_for_worker(proc)
        time.sleep(1.0)   # 让它进入生成
        os.killpg(proc.pid, signal.SIGINT) if how == "Ctrl-C" else os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert_group_gone(proc.pid)
    finally:
        if group_pids(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    if how == "Ctrl-C":
        assert proc.returncode == 130 and err.strip().splitlines() == ["error: interrupted"], err[-2000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_run_the_pipeline(tiny_tok_dir):
    """同一台机器上两个 torchrun "节点"（--nnodes 2 --node-rank 0/1 --rdzv-endpoint 127.0.0.1:PORT），每个节点一个进程、
    一个 stage：--pp 2 的输出与一个进程的 run.py（--tp 1 --pp 1）相同；只有 rank 0 打印。"""
    port = free_port()
    args = ["--model", str(tiny_tok_dir), "--prompt", "Hello there", "--prompt", "The capital of", "--max-new-tokens",
            "6", "--ignore-eos", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(n), "--rdzv-endpoint", f"127.0.0.1:{port}", RUN_PY, *args, "--pp", "2"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for n in (0, 1)]
    try:
        outs = [n.communicate(timeout=120) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert got["stats"]["pp"] == 2 and not outs[1][0].strip()
    model = load_model(tiny_tok_dir, "cpu", torch.float32)            # 参考：一个进程、完整的模型
    requests = [Request(r["prompt_ids"], 6, ignore_eos=True) for r in got["results"]]
    ref = LLMEngine(model, EngineConfig(got["stats"]["num_blocks"])).generate(requests).outputs
    assert [r["output_ids"] for r in got["results"]] == ref
