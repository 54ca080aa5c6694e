"""step02 的采样器：从最后一个位置的 logits (V,) 选出下一个 token。

处理顺序与 HF transformers 的 generate 相同（第 02 章解释为什么是这个顺序）：

    logits ─ 重复惩罚 ─ 温度 ─ top-k ─ top-p ─ min-p ─ softmax ─ 抽样 (draw)
                      └─ 贪心（temperature == 0 或 top_k == 1）：直接 argmax，不消耗随机数

每个过滤器都只是把"不允许"的 token 的 logit 设成 -inf：softmax 之后它们的概率正好是 0，
剩下的 token 自动重新归一化。所有函数都不修改传入的张量。
"""
import math
from dataclasses import dataclass

import torch

from common.errors import UserError

TOP_P_FIRST_K = 256   # top-p 先看概率最高的这么多个 token（不够再放大），见 apply_top_p


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0 = 贪心；<1 让分布更尖，>1 更平
    top_k: int = 0                    # 0 = 不限制；只在概率最高的 k 个 token 里抽
    top_p: float = 1.0                # 1 = 不限制；只保留累计概率刚好达到 p 的最小集合（nucleus）
    min_p: float = 0.0                # 0 = 不限制；去掉概率 < min_p × 最大概率 的 token
    repetition_penalty: float = 1.0   # 1 = 不惩罚；>1 压低出现过的 token（HF / CTRL 的定义）
    seed: int | None = None           # None = 每次随机；给定种子 → 同一设备上输出可复现

    def validate(self) -> None:
        """非法值抛 UserError（run.py 把它变成一行 `error: ...`、退出码 2）。"""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise UserError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not (0 < self.top_p <= 1):   # NaN 在这里也不成立
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise UserError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise UserError(f"seed must be an integer in [0, 2^63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        """temperature 0 或 top_k 1 时只剩一个候选：结果与贪心（argmax）相同，不需要随机数。"""
        return self.temperature == 0 or self.top_k == 1


def make_generator(seed: int | None, device) -> torch.Generator:
    """每个请求一个自己的随机数发生器：结果只取决于它自己的种子，而不取决于进程里别的代码用过多少随机数
    （全局的 torch.manual_seed 做不到这一点；step04 起多个请求同批时更需要这样）。"""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()            # 从系统熵取一个不确定的种子
    else:
        g.manual_seed(seed)
    return g


def apply_repetition_penalty(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """HF / CTRL 的定义：history 里出现过的每个 token（出现多次也只罚一次），logit 为正就除以 penalty，
    为负就乘以 penalty —— penalty > 1 时两种情况都让它变小。没出现过的 token 不变。"""
    if penalty == 1.0 or not history:
        return logits
    idx = torch.tensor(sorted(set(history)), device=logits.device)   # (n,)：去重后的 token id
    seen = logits[idx]                                                 # (n,)
    out = logits.clone()
    out[idx] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return out


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(z / T)：T < 1 拉大差距（更确定），T > 1 缩小差距（更随机）。T = 0 的极限是 argmax，由 greedy 处理。"""
    return logits / temperature


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """只保留 logit 最大的 k 个（与第 k 名并列的也保留，与 HF 相同）。"""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]                 # 第 k 大的 logit
    return logits.masked_fill(logits < kth, -math.inf)


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """nucleus：按概率从大到小排，保留"排在它前面的概率和 < p"的 token，
    即累计概率第一次达到 p 的最小前缀（概率最大的那个 token 永远保留）。

    教科书写法是把整个词表排序再累加；但 CPU 上 torch.sort 排 49152 个数很慢（run.py 的基准里有对照的一行），
    而核心集合通常只有几十到几百个 token。所以先用 topk 只取前 k 名（从大到小）：前 k 名里已经凑够 p，
    后面的就不必再看；不够再把 k 放大 4 倍。结果与整表排序相同。"""
    if p >= 1.0:
        return logits
    probs = logits.softmax(-1)                                 # (V,)
    vocab = probs.shape[-1]
    k = min(TOP_P_FIRST_K, vocab)
    while True:
        top_probs, top_ids = probs.topk(k)                     # (k,), (k,)：前 k 名，从大到小
        mass_before = top_probs.cumsum(-1) - top_probs         # (k,)：排在第 i 名之前的概率和
        if k == vocab or mass_before[-1] >= p:                 # 第 k 名之前已凑够 p：它和之后的都不要
            break
        k = min(4 * k, vocab)
    keep = torch.zeros_like(probs, dtype=torch.bool)           # (V,)
    keep[top_ids[mass_before < p]] = True                      # 前面的和还不到 p：保留（排序位置 → token id）
    return logits.masked_fill(~keep, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """去掉概率 < min_p × 最大概率 的 token：模型越有把握（最大概率越高），门槛越高、保留越少。"""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)                             # (V,)
    return logits.masked_fill(probs < min_p * probs.max(), -math.inf)


def process_logits(logits: torch.Tensor, history: list[int], params: SamplingParams) -> torch.Tensor:
    """非贪心时的整条处理链（顺序同 HF）：返回处理后的 logits (V,)，被过滤掉的是 -inf。"""
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    logits = apply_temperature(logits, params.temperature)
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    return apply_min_p(logits, params.min_p)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """逆变换抽样：取 u ~ U[0, 总和)，返回累计概率第一次超过 u 的 token。
    token i 被选中当且仅当 u 落在 [cdf[i-1], cdf[i]) 里，这段长度正好是 probs[i]；概率为 0 的 token 长度为 0，
    永远不会被选中。（torch.multinomial 做的是同一件事。）"""
    cdf = probs.cumsum(-1)                                                   # (V,)
    u = torch.rand((), generator=generator, device=probs.device) * cdf[-1]   # 乘总和：吸收 float32 累加的舍入误差
    return int(torch.searchsorted(cdf, u, right=True))


def sample(logits: torch.Tensor, history: list[int], params: SamplingParams, generator: torch.Generator) -> int:
    """logits: (V,) float32，最后一个位置的输出；history: 提示词 + 已生成的 token（重复惩罚用）。"""
    if params.greedy:
        # 贪心也要先做重复惩罚（HF 的 do_sample=False 同样如此）；温度和各种截断都不改变 argmax
        return int(apply_repetition_penalty(logits, history, params.repetition_penalty).argmax())
    probs = process_logits(logits, history, params).softmax(-1)   # (V,)：被过滤的 token 概率正好为 0
    return draw(probs, generator)


def draw_margin(params: SamplingParams):
    """给 common.compare 用的"离打平多远"（带种子的采样）：返回 f(logits, history, pos, token)；贪心返回 None。
    重放这个请求的发生器到第 pos 次抽样（非贪心时每个 token 正好抽一次随机数），得到当时的 u；
    token 在累计分布上占区间 [cdf[token-1], cdf[token])，返回 u 到较近那条边界的距离（概率单位）。
    距离很小时，logits 末位的差别就足以把 u 划进相邻 token 的区间。"""
    if params.greedy:
        return None               # 贪心：compare 用默认的 top-2 logit 差
    if params.seed is None:
        raise ValueError("draw_margin needs a seed: without one the draws cannot be replayed")

    def margin(logits: torch.Tensor, history: list[int], pos: int, token: int) -> float:
        cdf = process_logits(logits, history, params).softmax(-1).cumsum(-1)   # (V,)
        g = make_generator(params.seed, logits.device)
        for _ in range(pos + 1):                                                 # 第 0..pos 次抽样
            r = torch.rand((), generator=g, device=logits.device)
        u = float(r * cdf[-1])                                                   # 与 draw() 相同
        lo = float(cdf[token - 1]) if token > 0 else 0.0
        return min(abs(u - lo), abs(float(cdf[token]) - u))

    return margin


def add_sampling_args(parser) -> None:
    """step02 起每个 run.py 都有的采样参数；默认值 = 贪心。取值检查在 params_from_args 里（给出 `error:`）。"""
    g = parser.add_argument_group("采样（默认贪心）")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = 贪心（默认）")
    g.add_argument("--top-k", type=int, default=0, help="0 = 不限制")
    g.add_argument("--top-p", type=float, default=1.0, help="(0, 1]，1 = 不限制")
    g.add_argument("--min-p", type=float, default=0.0, help="[0, 1]，0 = 不限制")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0，1 = 不惩罚")
    g.add_argument("--seed", type=int, default=None, help="随机种子：同一设备上同一种子输出相同")


def params_from_args(args) -> SamplingParams:
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed)
    params.validate()
    return params
