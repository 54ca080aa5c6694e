"""一个 rank 上的模型执行：本 rank 的 KV 池子、本 rank 那一份模型、第二层（--preempt swap），给一步的计划跑一次前向。

    ModelRunner(model, config, parallel)   建池子（与第二层）；model 是本 rank 的那一份（parallel_layers.py）
    run(seqs, num_new_tokens, prompt_logits)   kv_cache.plan 排出这次前向的地址信息，跑前向：返回 (fwd, logits)
    run_worker()                           rank ≠ 0：收 rank 0 的计划 → 照做换出 / 换入 → run，直到 END
    close()                                结束这个引擎：rank 0 发 END，每个 rank 交出自己的通信账

rank 0 的引擎（engine.py）拥有一个 ModelRunner：调度器、块管理器、采样、投机的提议者都在引擎里，只在 rank 0 上。
其余 rank 只有 ModelRunner（serve_worker）：它们没有自己的决定可做，照着计划算就行，用不到调度器。
vLLM 的分法相同：Scheduler 只在 EngineCore 里，每个 worker 有一个 GPUModelRunner。

块号、槽号在每个 rank 上相同（同一个 plan 从同样的计划算出来），只是每个 rank 的池子按它自己的 model.cfg 建：
本 stage 的层 × 本 rank 的 KV 头。所以同样的每 rank 内存，池子能放 TP 倍的 token。
"""
import torch

from common.errors import UserError

from .kv_cache import PagedKVCache
from .parallel_layers import load_shard
from .quant import kv_format
from .step_message import decode_plan, plan_numel
from .swap import SwapSpace


class ModelRunner:
    def __init__(self, model, config, parallel=None):
        """config：engine.py 的 EngineConfig（rank 0 检查过；worker 收到的是同一份）。parallel：distributed.py 的
        ParallelContext（None = 一个进程）。"""
        self.model, self.parallel = model, parallel
        try:  # 整个池子只分配一次；--num-blocks 过大时给一行 error 而不是 traceback
            self.kv_cache = PagedKVCache(model.cfg, config.num_blocks, config.block_size, model.device, model.dtype,
                                         config.attention, kv_format(config.kv_dtype, model.dtype))
            self.swap = (SwapSpace(self.kv_cache.tensors(), config.swap_blocks or config.num_blocks, block_dim=2,
                                   record=parallel is not None and parallel.rank == 0)
                         if config.preempt == "swap" else None)
        except (RuntimeError, MemoryError) as e:
            raise UserError(f"cannot allocate a KV pool of {config.num_blocks} blocks x {config.block_size} "
                            f"tokens: {e}") from None

    def run(self, seqs, num_new_tokens: list[int], prompt_logits=None):
        """一次前向：返回 (fwd, logits)。fwd 是这次前向的地址信息（kv_cache.plan）；logits (1, R, V) 只在 rank 0 上有，
        其他 rank 是 None。seqs 在 rank 0 上是 Sequence，在 worker 上是 step_message.WorkerSeq（plan 读的几项同名）。
        prompt_logits：plan 的同名参数（要 prompt logprobs 的请求还要 logits 的提示词位置）。"""
        fwd = self.kv_cache.plan(seqs, num_new_tokens, prompt_logits)
        return fwd, self.model(fwd.input_ids, fwd.positions, fwd, logits_index=fwd.logits_index)

    @torch.inference_mode()
    def run_worker(self) -> None:
        """rank ≠ 0 只做这一件事：收 rank 0 的计划，照做它这一步的换出 / 换入，跑本 rank 那一份前向（通信在模型的
        层里），直到 rank 0 的引擎结束。"""
        while (plan := decode_plan(self.parallel.broadcast_plan())) is not None:
            if self.swap is not None:
                self.swap.replay(plan.swap_copies)
            self.run(plan.seqs, plan.num_new_tokens, plan.prompt_logits)
        self.close()

    def close(self) -> list[dict]:
        """结束这个引擎：多进程时 rank 0 发 END，每个 rank 离开这个引擎；返回每个 rank 的通信账（rank 0 上）。
        某个 worker 出过错时什么也不发、不抛错，返回 []。"""
        if self.parallel is None or self.parallel.plan_numel is None:
            return []
        return self.parallel.close_engine()


def serve_worker(parallel, model_dir, device: str, dtype: torch.dtype, linear: str = "auto") -> None:
    """rank ≠ 0 的全部工作（launch 的 worker_main）：装上自己那一份模型；rank 0 每建一个引擎，就按同一份配置
    建一个 ModelRunner，跑到那个引擎结束。猜测只在 rank 0 上做（草稿模型也只在那里）：要验证的猜测已经写在计划里。"""
    model = load_shard(model_dir, parallel, device, dtype, linear)
    while (config := parallel.broadcast_object()) is not None:
        parallel.open_engine(config, plan_numel(config, model.cfg))
        ModelRunner(model, config, parallel).run_worker()
