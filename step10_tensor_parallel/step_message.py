"""rank 0 每一步广播给所有 rank 的计划：调度器的决定，编成一个定长的 int32 张量，一次 broadcast。

每个 rank 收到后调用同一个 `PagedKVCache.plan(seqs, num_new_tokens, prompt_logits)`，用自己的池子
排出这次前向的地址信息——input_ids、位置、slot_mapping、块表、每个请求的 key 数与 query 数、要算 logits 的行
（logits_index：算完了的请求的最后一个 token，验证的行是最后 k+1 个，要 prompt logprobs 的请求还有它这一块里的
提示词位置；各 rank 的 lm_head 算同样的行）、
gather 读法的段都从这几样算出来，所以每个 rank 的计划逐位相同，worker 永远不会和 rank 0 走岔。这也是 vLLM V1 的做法：广播调度器的输出
（SchedulerOutput），每个 worker 自己准备输入；V0 则由 driver 准备好张量再逐个广播。

布局（int32；第一个数 < 0 是控制消息：END = 这个引擎结束了，HEARTBEAT = rank 0 还在、只是空闲，见 distributed.py）：

    [R, T, n_table, n_copy]                                          头：请求数、新 token 总数、块表总长、换出/换入的拷贝数
    R × [num_computed_tokens, num_new_tokens, num_tokens, len(spec_token_ids), len(block_table),
         prompt_logits.start, prompt_logits.stop]                    还要 logits 的提示词位置（Sequence.prompt_logits）
    T 个新 token id                                                  每个请求这一步要算的 token（验证的行：最后几个是猜测），首尾相接
    n_table 个块号                                                   每个请求的块表，首尾相接
    n_copy × [方向, 池子块号, 第二层块号]                             --preempt swap：调度器这一步做的拷贝（swap.py），
                                                                     每个 rank 对自己那一份池子照做一遍
    0 ...                                                            补到定长

为什么定长：集合通信不带形状，接收方要事先准备好同样大小的张量。最长的计划能算出来：R ≤ max_batch_size，
T ≤ max_num_batched_tokens，块表 ≤ 上下文长度的块数，拷贝 ≤ 第二层块数 + 池子块数；多出来的是 0，
SmolLM2 默认配置下不到 20 KB。
"""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from step04_static_batching.batch import PAD_ID

HEADER, ROW = 4, 7
END = -1          # 第一个数是 END：这个引擎结束了（rank 0 的 close()）
HEARTBEAT = -2    # 第一个数是 HEARTBEAT：rank 0 空闲时的心跳，worker 收到就接着等（distributed.py）


@dataclass
class WorkerSeq:
    """worker 眼里的一个请求：只有这一步用得到的东西（plan 读的那几项，与 Sequence 同名）。位置 num_computed_tokens
    之前的 token 已经以 K/V 的形式在每个 rank 自己的池子里，worker 不需要知道它们是什么。"""
    num_computed_tokens: int
    num_tokens: int
    block_table: list[int]
    new_token_ids: list[int]       # 位置 num_computed_tokens 起、这一步要算的 token（含猜测）
    num_spec: int                  # 其中最后几个是猜测

    @property
    def token_ids(self) -> list[int]:
        """与 Sequence.token_ids 同样的下标：plan 只取 [num_computed_tokens : …]，之前的位置填 PAD。"""
        return [PAD_ID] * self.num_computed_tokens + self.new_token_ids[:len(self.new_token_ids) - self.num_spec]

    @property
    def spec_token_ids(self) -> list[int]:
        return self.new_token_ids[len(self.new_token_ids) - self.num_spec:]

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + self.num_spec


class StepPlan(NamedTuple):
    seqs: list[WorkerSeq]
    num_new_tokens: list[int]
    swap_copies: list[tuple[int, int, int]]   # (0 = 换出 / 1 = 换入, 池子块号, 第二层块号)，按发生的顺序
    prompt_logits: list[range]                # 与 seqs 一一对应：还要 logits 的提示词位置（plan 的同名参数）


def plan_numel(config, cfg) -> int:
    """这个引擎配置下最长的计划有多少个数（每个 rank 用同一个公式算出同一个缓冲区大小）。"""
    table = min(config.num_blocks, -(-cfg.max_position_embeddings // config.block_size) + 1)
    # 一步里换出的块 ≤ 第二层的块数（每块占第二层一块），换入的 ≤ 池子的块数
    copies = (config.swap_blocks or config.num_blocks) + config.num_blocks if config.preempt == "swap" else 0
    R = config.max_batch_size
    return HEADER + ROW * R + config.max_num_batched_tokens + R * table + 3 * copies


def encode_plan(seqs, num_new_tokens: list[int], swap_copies: list, numel: int) -> torch.Tensor:
    rows, ids, tables = [], [], []
    for seq, n in zip(seqs, num_new_tokens):
        c = seq.num_computed_tokens
        want = seq.prompt_logits
        rows += [c, n, seq.num_tokens, len(seq.spec_token_ids), len(seq.block_table), want.start, want.stop]
        ids += (seq.token_ids + seq.spec_token_ids)[c:c + n]     # 与 plan 取的同一段
        tables += seq.block_table
    flat = ([len(seqs), len(ids), len(tables), len(swap_copies)] + rows + ids + tables
            + [x for cp in swap_copies for x in cp])
    if len(flat) > numel:   # plan_numel 算错了：是 bug，不是用户的错
        raise RuntimeError(f"step plan of {len(flat)} numbers does not fit the {numel}-number broadcast buffer")
    out = torch.zeros(numel, dtype=torch.int32)
    out[:len(flat)] = torch.tensor(flat, dtype=torch.int32)
    return out


def decode_plan(buf: torch.Tensor) -> Optional[StepPlan]:
    """encode_plan 的逆；END 返回 None。"""
    v = buf.tolist()
    R, T, n_table, n_copy = v[:HEADER]
    if R == END:
        return None
    rows = [v[HEADER + ROW * i:HEADER + ROW * (i + 1)] for i in range(R)]
    at_ids, at_table = HEADER + ROW * R, HEADER + ROW * R + T
    seqs, num_new, prompt_logits = [], [], []
    for c, n, num_tokens, n_spec, n_blocks, want_start, want_stop in rows:
        seqs.append(WorkerSeq(c, num_tokens, v[at_table:at_table + n_blocks], v[at_ids:at_ids + n], n_spec))
        num_new.append(n)
        prompt_logits.append(range(want_start, want_stop))
        at_ids, at_table = at_ids + n, at_table + n_blocks
    at = HEADER + ROW * R + T + n_table
    copies = [tuple(v[at + 3 * i:at + 3 * i + 3]) for i in range(n_copy)]
    return StepPlan(seqs, num_new, copies, prompt_logits)
