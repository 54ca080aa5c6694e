"""引擎的时钟：时刻从外面传进来（引擎只调用 clock.now()），测试里换成虚拟时钟，结果就不取决于机器快慢。

    WallClock     真实运行：perf_counter，从创建时算起；advance_to 把"没有请求可做"的空闲直接拨过去（不真的睡）
    VirtualClock  测试：时间只在调用方说"过了"时才走——replay 每跑完一步 tick() 一次，到达时刻按"第几步"给

"请求陆续到达"的负载由 common/harness.py 的 replay 驱动：到达时刻一到就 add_request，其余时间一步一步 step()。
"""
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...
    def advance_to(self, t: float) -> None: ...   # 空闲时把时钟拨到 t（t 不早于 now()）
    def tick(self) -> None: ...                   # 引擎跑完一步


class WallClock:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.idle_s = 0.0           # advance_to 拨过去的时间之和

    def now(self) -> float:
        return time.perf_counter() - self.t0 + self.idle_s

    def advance_to(self, t: float) -> None:
        self.idle_s += max(0.0, t - self.now())

    def tick(self) -> None:
        pass                        # 真实的时间自己会走


class VirtualClock:
    """每一步恰好 step_s 秒：谁在哪一步到达、和谁同批只取决于步数。"""

    def __init__(self, step_s: float = 1.0):
        self.t, self.step_s, self.idle_s = 0.0, step_s, 0.0

    def now(self) -> float:
        return self.t

    def advance_to(self, t: float) -> None:
        self.idle_s += max(0.0, t - self.t)
        self.t = max(self.t, t)

    def tick(self) -> None:
        self.t += self.step_s
