"""step02 的采样器：从最后一个位置的 logits (V,) 选出下一个 token。

处理顺序（第 02 章解释为什么是这个顺序）：

    logits ─ logit_bias ─ 重复惩罚 ─ presence/frequency 惩罚 ─ min_tokens 屏蔽 ─ 温度 ─ top-k ─ top-p ─ min-p ─ softmax ─ 抽样 (draw)
                                                                            └─ 贪心（temperature < SAMPLING_EPS 或 top_k == 1）：直接 argmax，不消耗随机数

前四项（adjust_logits）会改变 argmax，所以贪心也要做；与 HF generate 的顺序相同（SequenceBias → RepetitionPenalty →
MinNewTokensLength → 温度……），presence/frequency 是 OpenAI 的定义，放在重复惩罚之后（vLLM 的 apply_penalties 也是这个顺序）。
vLLM 把 min_tokens 放在惩罚之前：被屏蔽的是 -inf，惩罚怎么加减乘除都还是 -inf，两种顺序结果相同。

采样器要分开看提示词和已生成的 token：重复惩罚看两者（HF / vLLM 相同），presence / frequency 惩罚只数已生成的
（OpenAI / vLLM 的定义），min_tokens 看已生成了几个。所以参数是 prompt_ids、output_ids 两个列表，而不是一条 history。

每个过滤器都只是把"不允许"的 token 的 logit 设成 -inf：softmax 之后它们的概率正好是 0，
剩下的 token 自动重新归一化。所有函数都不修改传入的张量。

极端但合法的参数（validate 接受的都算）也必须得到一个有定义的 token，绝不能抽出词表外的 id：
  · 温度 < SAMPLING_EPS (1e-5) 按贪心处理（vLLM 的 _SAMPLING_EPS 同样如此）：z / 1e-40 会溢出成 inf，
    几个 inf 进 softmax 得 NaN；而温度趋于 0 的极限本来就是 argmax。
  · 重复惩罚、presence/frequency 惩罚的结果夹在 ±LOGIT_LIMIT 之内：z / 1e-40 同样会溢出；夹住之后再除以不小于
    SAMPLING_EPS 的温度也仍然有限。logit_bias 限制在 [-100, 100]：每个 token 都 -100 也只是整体平移，分布不变。
  · min_tokens 屏蔽不会把整个词表都屏蔽掉（stop_token_ids 覆盖了整个词表时不屏蔽：否则没有 token 可选）。
  · 很大的温度（1e6）把分布压平，接近均匀分布，本来就有定义；top-p 1e-30 只留概率最大的一个 token。
  · 每个过滤器都至少留下概率最大的那个 token，所以 softmax 的分母 ≥ 1，不会是 0 / 0。
  · draw() 的总和不是有限正数时报错（那是上游的 bug），而不是返回 V。
"""
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from common.errors import UserError

TOP_P_FIRST_K = 256   # top-p 先看概率最高的这么多个 token（不够再放大），见 apply_top_p
# 温度低于它就当作贪心：与 vLLM 的 _SAMPLING_EPS 相同。这么小的温度下 softmax(z / T) 已经是 argmax 上的 one-hot
# （logit 差 0.01 就是 e^-1000），再小只会让 z / T 溢出；等于 1e-5 本身仍然抽样
SAMPLING_EPS = 1e-5
# 惩罚后 logit 的绝对值上限：比真实模型的 logit（几十以内）大得多，又小到除以最小的非贪心温度 SAMPLING_EPS
# 也还是有限的 float32（1e30 / 1e-5 = 1e35 < 3.4e38）
LOGIT_LIMIT = 1e30
MAX_PENALTY = 2.0      # presence / frequency 惩罚的范围 [-2, 2]（OpenAI 的规定）
MAX_LOGIT_BIAS = 100.0  # logit_bias 的范围 [-100, 100]（OpenAI 的规定：-100 基本等于禁止，100 基本等于只选它）


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0（或 < SAMPLING_EPS）= 贪心；<1 让分布更尖，>1 更平
    top_k: int = 0                    # 0 = 不限制；只在概率最高的 k 个 token 里抽
    top_p: float = 1.0                # 1 = 不限制；只保留累计概率刚好达到 p 的最小集合（nucleus）
    min_p: float = 0.0                # 0 = 不限制；去掉概率 < min_p × 最大概率 的 token
    repetition_penalty: float = 1.0   # 1 = 不惩罚；>1 压低出现过的 token（HF / CTRL 的定义，看提示词 + 已生成）
    seed: int | None = None           # None = 每次随机；给定种子 → 同一设备上输出可复现
    # OpenAI 的定义（只数已生成的 token）：logit -= 出现次数 × frequency_penalty + (出现过 ? 1 : 0) × presence_penalty
    presence_penalty: float = 0.0     # [-2, 2]，0 = 不惩罚；>0 鼓励换话题，<0 鼓励重复
    frequency_penalty: float = 0.0    # [-2, 2]，0 = 不惩罚；>0 出现越多压得越低
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id → 加到 logit 上的偏置，[-100, 100]
    min_tokens: int = 0               # 生成满这么多个 token 之前，EOS 与 stop_token_ids 被屏蔽，停止字符串也不算
    stop_token_ids: tuple[int, ...] = ()   # 生成了其中任一个就停（finish_reason "stop"；这个 token 算进输出）

    def validate(self, vocab_size: int | None = None) -> None:
        """非法值抛 UserError，消息里写字段名（run.py 把它变成一行 `error: ...`、退出码 2；服务端回 400）。
        vocab_size：给了就检查 logit_bias 与 stop_token_ids 里的 token id 在 [0, vocab_size) 之内（引擎知道词表大小）。

        接受的参数空间（其中每一点都得到一个有定义的、词表内的 token）：
            temperature         有限且 >= 0；< SAMPLING_EPS (1e-5) 按贪心处理（包括 1e-40 这样的次正规数）
            top_k               整数 >= 0；0 = 不限制，1 = 贪心
            top_p               (0, 1]；再小（1e-30）也至少留下概率最大的 token
            min_p               [0, 1]；1 = 只留概率最大的（并列的都留）
            repetition_penalty  有限且 > 0；1e-40 或 1e6 这样的极端值结果夹在 ±LOGIT_LIMIT 之内
            seed                None 或 [0, 2^63) 里的整数
            presence_penalty    [-2, 2]
            frequency_penalty   [-2, 2]
            logit_bias          {token id: [-100, 100]}
            min_tokens          整数 >= 0
            stop_token_ids      token id 的序列
        """
        # 先查类型：True 是 int 的子类（True == 1），不排除就会被当成 top_k 1、种子 1、惩罚 1 悄悄接受
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                raise UserError(f"{name} must be a number, got {getattr(self, name)!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise UserError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0 < self.top_p <= 1):   # NaN 在这里也不成立
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise UserError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63):
            raise UserError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-MAX_PENALTY <= v <= MAX_PENALTY):   # NaN 不成立
                raise UserError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            raise UserError(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        if not isinstance(self.logit_bias, dict):
            raise UserError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
        for t, b in self.logit_bias.items():
            _check_token_id("logit_bias", t, vocab_size)
            if not (_is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS):
                raise UserError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                f"got {b!r} for token {t}")
        for t in self.stop_token_ids:
            _check_token_id("stop_token_ids", t, vocab_size)

    @property
    def greedy(self) -> bool:
        """温度 < SAMPLING_EPS（含 0）或 top_k 1 时只剩一个候选：结果与贪心（argmax）相同，不需要随机数。
        每一步、每个地方（sample、process_logits、draw_margin、投机解码的验证与草稿）都用这一个判断。"""
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_token_id(name: str, t, vocab_size: int | None) -> None:
    if not (_is_int(t) and t >= 0 and (vocab_size is None or t < vocab_size)):
        where = "an integer >= 0" if vocab_size is None else f"in [0, {vocab_size})"
        raise UserError(f"{name}: token ids must be {where}, got {t!r}")


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
    为负就乘以 penalty —— penalty > 1 时两种情况都让它变小。没出现过的 token 不变。

    极端的 penalty 也要得到有限的结果（普通的取值下两步都不起作用，结果与 HF 逐位相同）：
    penalty 先夹到 float32 的正规数范围——更小的（1e-45）在 float32 里变成 0，z / 0 = inf；更大的变成 inf，
    -z × inf = -inf；结果再夹到 ±LOGIT_LIMIT——z / 1e-40 会溢出成 inf，几个 inf 进 softmax 就是 NaN。"""
    if penalty == 1.0 or not history:
        return logits
    finfo = torch.finfo(logits.dtype)
    penalty = min(max(penalty, finfo.tiny), finfo.max)
    idx = torch.tensor(sorted(set(history)), device=logits.device)   # (n,)：去重后的 token id
    seen = logits[idx]                                                 # (n,)
    out = logits.clone()
    out[idx] = torch.where(seen < 0, seen * penalty, seen / penalty).clamp(-LOGIT_LIMIT, LOGIT_LIMIT)
    return out


def apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> torch.Tensor:
    """OpenAI 的 logit_bias：把偏置加到指定 token 的 logit 上（HF 的 SequenceBiasLogitsProcessor 对单个 token 相同）。
    偏置在 [-100, 100]：结果有限；-100 几乎等于禁止（e^-100 ≈ 4e-44），但不是 -inf。"""
    if not bias:
        return logits
    idx = torch.tensor(list(bias), device=logits.device)                               # (n,)：dict 的键互不相同
    out = logits.clone()
    out[idx] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return out


def apply_penalties(logits: torch.Tensor, output_ids: Sequence[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI 的 presence / frequency 惩罚（vLLM 相同）：只数已生成的 token（提示词里的不算），c[t] = t 出现的次数，
        logit[t] -= c[t] × frequency + (c[t] > 0) × presence
    没出现过的 token 不变。结果夹在 ±LOGIT_LIMIT 之内（重复惩罚之后的 logit 可能已经在边上）。"""
    if (presence == 0 and frequency == 0) or not output_ids:
        return logits
    ids = torch.tensor(list(output_ids), device=logits.device)                        # (n,)
    counts = torch.bincount(ids, minlength=logits.shape[-1]).to(logits.dtype)          # (V,)
    penalty = counts * frequency + (counts > 0).to(logits.dtype) * presence            # (V,)
    return (logits - penalty).clamp(-LOGIT_LIMIT, LOGIT_LIMIT)


def apply_min_tokens(logits: torch.Tensor, num_output: int, min_tokens: int, end_ids: Collection[int]) -> torch.Tensor:
    """已生成的 token 还不到 min_tokens 个时，屏蔽会结束请求的 token（EOS 与 stop_token_ids；vLLM 的
    MinTokensLogitsProcessor、HF 的 MinNewTokensLengthLogitsProcessor）。它们覆盖了整个词表时不屏蔽：
    否则没有 token 可选（softmax 全是 -inf 得 NaN）；这样的请求照样生成到 min_tokens 个才可能因它们而停。"""
    if num_output >= min_tokens or not end_ids:
        return logits
    ids = sorted(set(end_ids))
    if len(ids) >= logits.shape[-1]:
        return logits
    out = logits.clone()
    out[torch.tensor(ids, device=logits.device)] = -math.inf
    return out


def adjust_logits(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams,
                  eos_ids: Collection[int] = ()) -> torch.Tensor:
    """处理链里会改变 argmax 的前半段（所以贪心也要做）：logit_bias → 重复惩罚（提示词 + 已生成）→
    presence/frequency 惩罚（只数已生成）→ min_tokens 屏蔽（EOS 与 stop_token_ids）。
    eos_ids：这个请求会因之结束的 EOS（ignore_eos 时传空）。都是默认值时原样返回同一个张量。
    为什么偏置在惩罚之前：与 HF（SequenceBias 在 RepetitionPenalty 之前）和 vLLM（logit_bias 在 apply_penalties 之前）
    相同，同样的参数得到同样的分布。"""
    logits = apply_logit_bias(logits, params.logit_bias)
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, [*prompt_ids, *output_ids], params.repetition_penalty)
    logits = apply_penalties(logits, output_ids, params.presence_penalty, params.frequency_penalty)
    if params.min_tokens > len(output_ids):
        logits = apply_min_tokens(logits, len(output_ids), params.min_tokens, [*eos_ids, *params.stop_token_ids])
    return logits


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(z / T)：T < 1 拉大差距（更确定），T > 1 缩小差距（更随机）。T → 0 的极限是 argmax，
    T < SAMPLING_EPS 由 greedy 处理，所以这里 T >= 1e-5、|z| <= LOGIT_LIMIT，z / T 不会溢出。
    T 很大时 z / T 趋于 0：接近均匀分布，仍然有定义。T 超出 float32 的范围（1e300）会先变成 inf，而被屏蔽的
    -inf / inf 是 NaN：所以 T 先截到这个 dtype 的最大有限值（-inf 除以它仍是 -inf）。"""
    return logits / min(temperature, torch.finfo(logits.dtype).max)


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
    keep[top_ids[0]] = True    # 最大的永远保留（同 HF 的 min_tokens_to_keep=1）：p < 1e-45 在 float32 里是 0，上一行一个也不留
    return logits.masked_fill(~keep, -math.inf)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """去掉概率 < min_p × 最大概率 的 token：模型越有把握（最大概率越高），门槛越高、保留越少。"""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)                             # (V,)
    return logits.masked_fill(probs < min_p * probs.max(), -math.inf)


def process_logits(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams,
                   eos_ids: Collection[int] = ()) -> torch.Tensor:
    """整条处理链：返回处理后的 logits (V,)，被过滤掉的是 -inf。
    每个过滤器都留下最大的那个 logit，所以结果里至少有一个有限值，softmax 不会得到 NaN。
    贪心时（温度 → 0 的极限）只留 adjust_logits 之后的 argmax（并列取 id 最小的，与 sample() 相同）：分布是 one-hot。"""
    logits = adjust_logits(logits, prompt_ids, output_ids, params, eos_ids)
    if params.greedy:
        keep = torch.zeros_like(logits, dtype=torch.bool)   # (V,)
        keep[logits.argmax()] = True
        return logits.masked_fill(~keep, -math.inf)
    logits = apply_temperature(logits, params.temperature)
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    return apply_min_p(logits, params.min_p)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """逆变换抽样：取 u ~ U[0, 总和)，返回累计概率第一次超过 u 的 token。
    token i 被选中当且仅当 u 落在 [cdf[i-1], cdf[i]) 里，这段长度正好是 probs[i]；概率为 0 的 token 长度为 0，
    永远不会被选中。（torch.multinomial 做的是同一件事。）

    两个边界：总和不是有限正数（NaN、inf、全 0）说明上游算错了——报错，而不是返回一个词表外的 id（V）；
    u = r × 总和（r < 1）舍入之后若正好等于总和（取决于设备与精度），searchsorted 会给出 V：这时取最后一个
    概率 > 0 的 token（它的区间右端就是总和）。"""
    cdf = probs.cumsum(-1)                                                   # (V,)
    total = float(cdf[-1])
    if not (math.isfinite(total) and total > 0):
        raise ValueError(f"draw: probabilities sum to {total}, expected a finite positive number")
    u = torch.rand((), generator=generator, device=probs.device) * cdf[-1]   # 乘总和：吸收 float32 累加的舍入误差
    token = int(torch.searchsorted(cdf, u, right=True))
    if token == len(cdf):
        token = int(torch.nonzero(probs)[-1])                                # 最后一个概率 > 0 的 token
    return token


def sample(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int], params: SamplingParams,
           generator: torch.Generator, eos_ids: Collection[int] = ()) -> int:
    """logits: (V,) float32，最后一个位置的输出；prompt_ids / output_ids：提示词与已生成的 token（惩罚与 min_tokens 用）；
    eos_ids：会结束这个请求的 EOS（min_tokens 之前屏蔽；ignore_eos 时传空）。"""
    if params.greedy:
        # 贪心也要先做偏置、惩罚与屏蔽（HF 的 do_sample=False 同样如此）；温度和各种截断都不改变 argmax
        return int(adjust_logits(logits, prompt_ids, output_ids, params, eos_ids).argmax())
    probs = process_logits(logits, prompt_ids, output_ids, params, eos_ids).softmax(-1)   # (V,)：被过滤的概率正好为 0
    return draw(probs, generator)


def draw_margin(params: SamplingParams, eos_ids: Collection[int] = ()):
    """给 common.compare 用的"离打平多远"（带种子的采样）：返回 f(logits, history, pos, token)；贪心返回 None。
    history = 提示词 + 参考的前 pos 个输出（所以最后 pos 个是已生成的）。
    重放这个请求的发生器到第 pos 次抽样（非贪心时每个 token 正好抽一次随机数），得到当时的 u；
    token 在累计分布上占区间 [cdf[token-1], cdf[token])，返回 u 到较近那条边界的距离（概率单位）。
    距离很小时，logits 末位的差别就足以把 u 划进相邻 token 的区间。"""
    if params.greedy:
        return None               # 贪心：compare 用默认的 top-2 logit 差
    if params.seed is None:
        raise ValueError("draw_margin needs a seed: without one the draws cannot be replayed")

    def margin(logits: torch.Tensor, history: list[int], pos: int, token: int) -> float:
        n_prompt = len(history) - pos
        cdf = process_logits(logits, history[:n_prompt], history[n_prompt:], params, eos_ids).softmax(-1).cumsum(-1)
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
    g.add_argument("--temperature", type=float, default=0.0, help=">= 0；0（或 < 1e-5）= 贪心（默认）")
    g.add_argument("--top-k", type=int, default=0, help=">= 0；0 = 不限制，1 = 贪心")
    g.add_argument("--top-p", type=float, default=1.0, help="(0, 1]，1 = 不限制；再小也留下概率最大的 token")
    g.add_argument("--min-p", type=float, default=0.0, help="[0, 1]，0 = 不限制")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="有限且 > 0，1 = 不惩罚")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="[-2, 2]，0 = 不惩罚；已生成过的 token 的 logit 减去它（OpenAI 的定义）")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="[-2, 2]，0 = 不惩罚；已生成的 token 的 logit 减去 出现次数 × 它")
    g.add_argument("--min-tokens", type=int, default=0,
                   help=">= 0：生成满这么多个 token 之前不会因 EOS、--stop-token-id、停止字符串而结束")
    g.add_argument("--stop-token-id", type=int, action="append", default=None, metavar="ID", dest="stop_token_ids",
                   help="停止 token（可重复）：生成了它就停，它算进输出")
    g.add_argument("--seed", type=int, default=None, help="随机种子：同一设备上同一种子输出相同")


def params_from_args(args) -> SamplingParams:
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            min_tokens=args.min_tokens, stop_token_ids=tuple(args.stop_token_ids or ()))
    params.validate()
    return params
