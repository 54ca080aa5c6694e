"""一个请求在引擎里的运行状态（vLLM / nano-vllm 叫 Sequence）。

step04 的 Sequence 已经记着"做到哪了"：已生成的 token、是否结束（max_new_tokens / EOS / 停止字符串）、
自己的随机数发生器、首 token 与结束的时刻。这里继承它，只加上分页和调度需要的状态：
块表、KV 已写进缓存的 token 数、状态、被抢占的次数、干等别人 prefill 的时间、每个输出 token 产出的时刻。
"""
import enum
from dataclasses import dataclass, field

from step04_static_batching.request import Sequence as BatchSequence


class Status(enum.Enum):
    WAITING = "waiting"     # 在等待队列里：还没有块（新来的，或被抢占后释放了全部块）
    RUNNING = "running"     # 在运行集合里：持有块，每步都参与调度
    FINISHED = "finished"   # 生成完毕，块已还给分配器


@dataclass(eq=False)
class Sequence(BatchSequence):
    block_table: list[int] = field(default_factory=list)  # 第 i 个逻辑块 → 物理块号
    num_cached_tokens: int = 0       # 前多少个 token 的 K/V 已经写进池里（其余的下一次前向要算）
    status: Status = Status.WAITING
    num_preemptions: int = 0
    stall_time: float = 0.0          # 已经在 decode、却因为这一步在给别人做 prefill 而干等的时间（秒）
    token_times: list[float] = field(default_factory=list)   # 每个输出 token 产出的时刻（秒）：相邻两个之差就是它等了多久

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)
