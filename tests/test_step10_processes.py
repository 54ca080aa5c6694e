"""step10：多进程出错与收尾（某个 worker 抛错或被 kill -9 时整组停下，rank 0 报出原因，进程全部退出；Ctrl-C 只由
rank 0 处理），空闲得比超时还久的一组照常服务（心跳），/health 看得到死掉的 worker，以及两个 torchrun "节点"跑流水线
（唯一起子进程的测试：要的就是真的 torchrun）。

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
from step10_tensor_parallel.distributed import WorkerFailed
from step10_tensor_parallel.launch import launch
from step10_tensor_parallel.model_runner import serve_worker
from step10_tensor_parallel.engine import EngineConfig, LLMEngine
from step10_tensor_parallel.parallel_layers import load_shard
from step04_static_batching.request import Request

ROOT = Path(__file__).resolve().parent.parent
RUN_PY = str(ROOT / "step10_tensor_parallel" / "run.py")
TEST_TIMEOUT = datetime.timedelta(seconds=60)   # 挂住的通信最多等这么久就抛错，测试不会一直挂着
IDLE = datetime.timedelta(seconds=3)            # 测试里 worker 等 rank 0 下一条消息的超时（默认 30 分钟）


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


def test_ctrl_c_is_handled_by_rank_0_alone(model_dir, request):
    """终端里的 Ctrl-C 发给整个进程组：worker 不理 SIGINT（它还在，下一步照常算），由 rank 0 收尾——KeyboardInterrupt
    穿过 launch，进程全部退出、进程组拆掉（run.py 再把它打印成一行 `error: interrupted`，与每一步的 run.py 相同）。"""
    requests = [Request([3, 4, 5, 6], 5), Request([7, 8, 9], 5)]
    # 终端里的 Python 进程对 SIGINT 的默认处理是抛 KeyboardInterrupt。但由非交互 shell 放到后台（`cmd &`）启动的进程
    # 继承"忽略 SIGINT"（POSIX：没有作业控制时后台命令忽略 SIGINT 与 SIGQUIT），Python 这时不装 default_int_handler，
    # pytest 与它的 xdist worker 从第一个测试起就是 SIG_IGN（不是哪个测试漏改的）。所以这里显式装上、测完换回
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    with pytest.raises(KeyboardInterrupt):
        with launch(2, 1, serve_worker, (model_dir, "cpu", torch.float32), threads=1, timeout=TEST_TIMEOUT) as par:
            engine = LLMEngine(load_shard(model_dir, par, "cpu", torch.float32), EngineConfig(32, 4, 4, 16),
                               parallel=par)
            (worker,) = multiprocessing.active_children()
            os.kill(worker.pid, signal.SIGINT)
            assert [len(o) for o in engine.generate(requests).outputs] == [5, 5]
            engine.add_request(requests[0])
            engine.step()
            signal.raise_signal(signal.SIGINT)                       # rank 0 在两步之间被打断
    assert not dist.is_initialized() and not multiprocessing.active_children()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_group_idle_longer_than_the_timeout_still_serves(model_dir, tp, pp):
    """服务器起来之后可以很久没有请求：worker 等下一步计划的 broadcast 有超时（这里缩短到 3 秒），rank 0 空闲时的
    心跳让它等得到。空闲 1.5 倍超时（4.5 秒）之后下一个请求照常算完、输出相同；关掉这个引擎、再空闲 4.5 秒（worker
    在等下一个引擎的配置），下一个引擎也照常。没有心跳时 worker 在空闲的第 3 秒就超时退出，两处都会失败。"""
    requests = [Request([3, 4, 5, 6, 7] * i, 6) for i in range(1, 3)]
    with launch(tp, pp, serve_worker, (model_dir, "cpu", torch.float32), threads=1, timeout=TEST_TIMEOUT,
                idle_timeout=IDLE) as par:
        model = load_shard(model_dir, par, "cpu", torch.float32)
        engine = LLMEngine(model, EngineConfig(32, 4, 4, 16, enable_prefix_caching=False), parallel=par)
        first = engine.generate(requests).outputs
        time.sleep(IDLE.total_seconds() * 1.5)
        assert engine.generate(requests).outputs == first and engine.worker_failure() is None
        assert len(engine.close()) == tp * pp
        time.sleep(IDLE.total_seconds() * 1.5)
        engine = LLMEngine(model, EngineConfig(32, 4, 4, 16, enable_prefix_caching=False), parallel=par)
        assert engine.generate(requests).outputs == first
    assert not dist.is_initialized() and not multiprocessing.active_children()


def test_a_dead_worker_is_reported_by_health_and_closing_is_quiet(model_dir):
    """空闲时一个 worker 被 kill -9：worker_failure()（服务器的 /health 用它）不通信就报出是哪个 rank；下一次 step()
    抛出同一个原因；之后 close() 与 launch 的收尾不再抛错（服务器退出时不该有 traceback），进程全部退出。"""
    with launch(2, 1, serve_worker, (model_dir, "cpu", torch.float32), threads=1, timeout=TEST_TIMEOUT) as par:
        engine = LLMEngine(load_shard(model_dir, par, "cpu", torch.float32), EngineConfig(32, 4, 4, 16), parallel=par)
        assert [len(o) for o in engine.generate([Request([3, 4, 5], 4)]).outputs] == [4]
        assert engine.worker_failure() is None
        (worker,) = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        failure = engine.worker_failure()
        assert isinstance(failure, WorkerFailed) and "rank 1 exited with code -9" in str(failure)
        with pytest.raises(WorkerFailed, match="rank 1 exited with code -9"):
            engine.generate([Request([3, 4, 5], 4)])
        assert engine.close() == []
    assert not dist.is_initialized() and not multiprocessing.active_children()


def test_closing_after_a_failed_step_is_quiet(model_dir):
    """一个 worker 在前向里抛错：那一步抛出 WorkerFailed（原因那一行）；之后 close() 返回 []、launch 的收尾不抛错——
    服务器在一步出错之后还要正常关闭（step11 的 serving_engine 在退出时调用 close()）。"""
    with launch(2, 1, exploding_worker, (model_dir, 1, 2), threads=1, timeout=TEST_TIMEOUT) as par:
        engine = LLMEngine(load_shard(model_dir, par, "cpu", torch.float32), EngineConfig(32, 4, 4, 16), parallel=par)
        with pytest.raises(WorkerFailed, match="rank 1: ValueError: boom in forward 2"):
            engine.generate([Request([3, 4, 5], 4)])
        assert engine.close() == [] and "boom in forward 2" in str(engine.worker_failure())
    assert not dist.is_initialized() and not multiprocessing.active_children()


def test_server_health_reports_a_dead_worker(tiny_tok_dir):
    """step11 的服务器挂 --tp 2 的 step10 引擎：worker 被 kill -9 之后 /health 回 503 并说出是哪个 rank，新请求回 503；
    服务器与 worker 照常收尾。"""
    import argparse

    import httpx

    from common.cli import open_session
    from step11_serving.server_thread import serve_in_thread
    from step11_serving.engines import add_engine_args, serving_engine
    s = open_session(str(tiny_tok_dir), "cpu", "float32")
    p = argparse.ArgumentParser()
    add_engine_args(p, "step10")
    with serving_engine("step10", s, p.parse_args(["--num-blocks", "64", "--block-size", "4", "--tp", "2"])) as engine:
        with serve_in_thread(s, engine, 4) as server:
            assert httpx.get(server.url + "/health").status_code == 200
            (worker,) = multiprocessing.active_children()
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
            r = httpx.get(server.url + "/health")
            assert r.status_code == 503 and "rank 1 exited with code -9" in r.json()["error"]
            assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503
    assert not dist.is_initialized() and not multiprocessing.active_children()


# ---------- torchrun（子进程）----------

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
