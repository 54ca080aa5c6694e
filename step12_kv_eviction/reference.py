"""驱逐策略的掩码模拟（mask simulation）：检查引擎里真实缓存的对照，与缓存不共用一行代码。

引擎（kv_cache.py、eviction.py、scheduler.py……）真的把被驱逐的 K/V 挪出池子：压紧到新块里、重新旋转、按槽记分数。
这里只模拟每个策略的*语义*，不模拟它的*做法*：

  - 一次只跑一个请求；每个 token 的 K/V 都连续存着，从不删（所以省不了内存，只用来对照）；
  - 每层、每个 KV 头一行布尔的 kept：哪些 token 此刻"在缓存里"。每一行 query 看得见 kept 的 token，
    加上自己这一块里不晚于自己的 token（因果）；其余 token 被掩码遮住——这就是"驱逐"在数学上的全部含义；
  - 位置：text = token 在全文里的下标；cache = key 此刻在自己那个 (层, 头) 的 kept 里排第几（query 排在 kept 之后）。
    每次前向从存着的 RoPE 之前的 K 从头旋转一遍，不用增量：引擎是压紧时乘 R(新槽 − 旧槽) 增量地转，
    两种算法得出同一个数才说明增量转对了；
  - 何时驱逐、驱逐成什么样在下面几个五行的函数里各写一遍：window / sinks / h2o 每次前向之后 kept 数 ≥ budget +
    block_size 就留 budget 个；snapkv（论文的规则）整个提示词算完之后、提示词长于 budget 时压缩一次，票是提示词最后
    w 个 token 的 query 对它们之前的 token 的注意力（这些 query 分在几块里算时票累加）；snapkv-chunked 每块提示词之后
    kept 数 ≥ budget + block_size 就按这一块最后 w 个 query 的票留 budget 个。两种 snapkv 在 decode 里都不驱逐。
    分数（h2o 累计的注意力概率、snapkv 的票）由这里自己的掩码注意力算出来。

怎么拿到 RoPE 之前的 K：传给模型的位置全是 0（cos = 1、sin = 0，apply_rope 是恒等变换），模型交给 attend 的
q、k 就是没转过的；attend 按这次前向的位置自己转 q、按每个 key 此刻的位置转 K（用模型自己的 rope，数值与模型相同）。

不 import 引擎的 kv_cache / gather / scheduler / block_manager / eviction：对照若与被查的代码共用一段，
那一段的 bug 两边一起错，查不出来。用到的只有 common/ 的模型与注意力（两边都用、由 step01 起的测试查过的部分）。

simulate() 的结果：每个算过的位置的 logits（位置 p 的一行给出第 p+1 个 token 的分布：提示词的 prompt logprobs
和生成时每一步的分布）、贪心生成的 token、每次前向之后 kept 的 token 数。
"""
from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

import torch
import torch.nn.functional as F

from common.model import apply_rope, attention

POLICIES = ("full", "window", "sinks", "h2o", "snapkv", "snapkv-chunked")


# ---- 留哪些：每个函数拿到此刻在缓存里的 n 个 token（按文本顺序排好），返回要留的那几个的下标（升序） ----

def keep_window(n: int, budget: int) -> torch.Tensor:
    """window：只留最近的 budget 个。"""
    return torch.arange(n - budget, n)


def keep_sinks(n: int, budget: int, num_sinks: int) -> torch.Tensor:
    """sinks（StreamingLLM）：最前面的 num_sinks 个 + 最近的 budget − num_sinks 个。"""
    return torch.cat([torch.arange(num_sinks), torch.arange(n - (budget - num_sinks), n)])


def keep_recent_and_top(scores: torch.Tensor, budget: int, recent: int) -> torch.Tensor:
    """h2o 与 snapkv 共用的规则：最近的 recent 个一定留；其余的里按分数取最高的 budget − recent 个，
    分数相同时先留下标小的（对 −分数做稳定排序）。scores (n,)，只看前 n − recent 个。"""
    n = scores.shape[0]
    order = torch.sort(-scores[:n - recent], stable=True).indices
    return torch.cat([order[:budget - recent].sort().values, torch.arange(n - recent, n)])


def snapkv_pooled(vote: torch.Tensor, window: int, pool: int) -> torch.Tensor:
    """snapkv：观察窗以外的 token（前 n − window 个）的票做一维最大池化（核 pool、步长 1、两边各补 pool // 2，
    补的位置不算数），让选中的 token 带上它的邻居。返回 (n,)：后 window 个的分数无所谓（它们一定留），填 0。"""
    n = vote.shape[0]
    pooled = F.max_pool1d(vote[None, None, :n - window], pool, stride=1, padding=pool // 2)[0, 0]
    return torch.cat([pooled, vote.new_zeros(window)])


# ---- 模拟用的缓存 ----

@dataclass
class MaskSimCache:
    """common/kv_cache.py 的 KVCache 接口：存下每个 token 的（RoPE 之前的）K 与 V，attend 时按 kept 掩码。
    K、V、kept 在请求的整个生命里都在（h2o 的累计分数在 simulate 里）；begin() 给出下一次前向的 token 范围。"""
    rope: torch.nn.Module
    num_layers: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    dtype: torch.dtype
    device: torch.device
    cache_positions: bool                      # True：位置 = kept 里的名次；False：位置 = 文本下标
    need_probs: bool = False                   # 这次前向要不要各层的注意力概率（h2o 每次都要，snapkv 投票的那几次要）
    vote_queries: int = 0                      # > 0：只取最后这么多个 query 的概率（snapkv 的观察窗落在这一块里的）
    mask: Optional[torch.Tensor] = None        # 接口要的属性；这里每层的掩码不同（kept 按层），在 attend 里现造
    k: torch.Tensor = field(init=False)        # (layers, H_kv, capacity, D) RoPE 之前的 K
    v: torch.Tensor = field(init=False)
    kept: torch.Tensor = field(init=False)     # (layers, H_kv, capacity) bool：此刻在缓存里
    probs_sum: list = field(init=False)        # 这次前向每层一个 (H_kv, n)：概率按 query 与同组的 query 头求和
    start: int = 0                             # 这次前向的第一个 token 的文本下标
    length: int = 0                            # 这次前向的 token 数

    def __post_init__(self):
        shape = (self.num_layers, self.num_kv_heads, self.capacity, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kept = torch.zeros(shape[:3], dtype=torch.bool, device=self.device)
        self.probs_sum = []

    def begin(self, start: int, length: int, need_probs: bool, vote_queries: int = 0) -> None:
        self.start, self.length, self.need_probs, self.vote_queries = start, length, need_probs, vote_queries
        self.probs_sum = []

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, heads, L, D)，positions (heads, L) 每个头自己的位置 → 按模型的 RoPE 转好。"""
        cos, sin = self.rope(positions, x.dtype)                            # (heads, L, D)
        return apply_rope(x.transpose(0, 1), cos, sin).transpose(0, 1)      # 模型的 apply_rope：头当作批那一维

    def update(self, layer_idx, k, v):
        raise NotImplementedError("MaskSimCache 只走 attend（每层的掩码与位置不同）")

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (1, H, L, D)、k/v (1, H_kv, L, D)，都还没转（模型拿到的位置是 0）。"""
        s, L = self.start, self.length
        n = s + L
        self.k[layer_idx, :, s:n] = k[0]
        self.v[layer_idx, :, s:n] = v[0]
        # 掩码 (H_kv, L, n)：之前的 token 看 kept，这一块内部因果
        old = self.kept[layer_idx, :, None, :s].expand(-1, L, -1)                       # (H_kv, L, s)
        new = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()[None].expand(self.num_kv_heads, -1, -1)
        mask = torch.cat([old, new], dim=-1)                                            # (H_kv, L, n)
        # 位置 (H_kv, n)：cache = kept 里的名次（这一块的 token 接在 kept 之后）；text = 下标。被遮住的 key 位置无所谓
        if self.cache_positions:
            kept_old = self.kept[layer_idx, :, :s].long()                               # (H_kv, s)
            kv_len = int(kept_old[0].sum())
            key_pos = torch.cat([kept_old.cumsum(-1) - 1,
                                 kv_len + torch.arange(L, device=q.device).expand(self.num_kv_heads, -1)], dim=-1)
            key_pos = key_pos.clamp(min=0)
            q_pos = kv_len + torch.arange(L, device=q.device)
        else:
            key_pos = torch.arange(n, device=q.device).expand(self.num_kv_heads, -1)
            q_pos = torch.arange(s, n, device=q.device)
        H = q.shape[1]
        q = self.rotate(q, q_pos.expand(H, -1))
        K = self.rotate(self.k[layer_idx, None, :, :n], key_pos)                       # (1, H_kv, n, D)
        V = self.v[layer_idx, None, :, :n]
        if self.need_probs:
            self.probs_sum.append(self.attention_probs(q, K, mask))
        return attention(q, K, V, mask[None, :, None])                                  # 与模型同一个注意力函数

    def attention_probs(self, q: torch.Tensor, K: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """自己算一遍注意力概率（float64，完整的 softmax 行），对 query（snapkv：只取最后 vote_queries 个）与
        同组的 query 头求和 → (H_kv, n)。"""
        H_kv, L, n = mask.shape
        D = q.shape[-1]
        qg = q[0].double().view(H_kv, -1, L, D)                                         # (H_kv, G, L, D)
        scores = qg @ K[0].double().transpose(-1, -2)[:, None] / D ** 0.5               # (H_kv, G, L, n)
        probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
        if self.vote_queries:
            probs = probs[:, :, -self.vote_queries:]
        return probs.sum(dim=(1, 2))                                                    # (H_kv, n)


# ---- 一个请求从头到尾 ----

@dataclass
class SimResult:
    logits: torch.Tensor          # (算过的位置数, V) float32：第 p 行 = 看到第 0..p 个 token 之后的 logits
    output_ids: list[int]         # 贪心生成的 token
    kept_after: list[int]         # 每次前向（及其后的驱逐）之后缓存里的 token 数
    num_compactions: int          # 驱逐发生了几次
    kept: torch.Tensor            # 最后的 kept 掩码 (layers, H_kv, 全部 token 数)
    selection_margin: float       # h2o / snapkv：每次挑选的相对余量（select()）的最小值：看有没有近乎平局

    def prompt_logprobs(self, prompt_ids: Seq[int]) -> torch.Tensor:
        """提示词第 1.. 个 token 的 logprob (P − 1,)：引擎 prompt_logprobs 的 chosen 那一项。"""
        lp = torch.log_softmax(self.logits[:len(prompt_ids) - 1].double(), dim=-1)
        return lp.gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]


def resolve_knobs(policy: str, budget: Optional[int], num_sinks=None, positions=None, h2o_recent=None,
                  snapkv_window=None, snapkv_pool=None) -> dict:
    """None 的旋钮换成设计里的默认值（与引擎相同的默认，这里各写一遍）。"""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}")
    if policy != "full" and budget is None:
        raise ValueError(f"policy {policy} needs a budget")
    return dict(
        num_sinks=4 if num_sinks is None else num_sinks,
        positions=positions or ("cache" if policy in ("window", "sinks") else "text"),
        h2o_recent=budget // 2 if h2o_recent is None and budget is not None else h2o_recent,
        snapkv_window=32 if snapkv_window is None else snapkv_window,
        snapkv_pool=7 if snapkv_pool is None else snapkv_pool)


@torch.inference_mode()
def simulate(model, prompt_ids: Seq[int], *, policy: str = "full", budget: Optional[int] = None,
             block_size: int = 16, chunk=None, num_sinks: Optional[int] = None, positions: Optional[str] = None,
             h2o_recent: Optional[int] = None, snapkv_window: Optional[int] = None, snapkv_pool: Optional[int] = None,
             max_new_tokens: int = 0) -> SimResult:
    """一个请求按策略跑完：提示词分块 prefill，再贪心生成 max_new_tokens 个 token（最后一个不再喂回模型）。

    chunk：提示词怎么切块，与引擎一致才可比：None = 一整块；整数 = 每块至多这么多（单独一个请求时引擎的
    max_num_batched_tokens）；列表 = 各块的大小（一批里有多个请求时，从引擎的调度记录里读出）。
    何时留、留哪些见文件开头（snapkv 是整个提示词之后一次，snapkv-chunked 是每块提示词之后）。"""
    knobs = resolve_knobs(policy, budget, num_sinks, positions, h2o_recent, snapkv_window, snapkv_pool)
    P = len(prompt_ids)
    if chunk is None:
        chunks = [P]
    elif isinstance(chunk, int):
        chunks = [min(chunk, P - i) for i in range(0, P, chunk)]
    else:
        chunks = list(chunk)
    if sum(chunks) != P or min(chunks) < 1:
        raise ValueError(f"chunks {chunks} do not cover the {P}-token prompt")
    cfg, dev = model.cfg, model.device
    total = P + max(max_new_tokens - 1, 0)
    cache = MaskSimCache(model.rope, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, total, model.dtype, dev,
                         cache_positions=knobs["positions"] == "cache")
    # h2o 的累计分数；snapkv 的票（提示词最后 w 个 query 的，跨块累加）
    scores = torch.zeros(cfg.num_layers, cfg.num_kv_heads, total, dtype=torch.float64, device=dev)
    w = knobs["snapkv_window"]
    tokens = list(prompt_ids)
    logits, kept_after, compactions, margin = [], [], 0, float("inf")
    steps = chunks + [1] * max(max_new_tokens - 1, 0)
    start = 0
    for i, L in enumerate(steps):
        is_prompt = i < len(chunks)
        kv_len = int(cache.kept[0, 0, :start].sum())
        if policy == "snapkv":     # 这一块里有几个 query 落在提示词的最后 w 个位置上；最后一块提示词之后压缩一次
            voters = max(0, min(L, start + L - (P - w))) if is_prompt else 0
            compact = i == len(chunks) - 1 and kv_len + L > budget
        else:
            compact = policy != "full" and kv_len + L >= budget + block_size and (policy != "snapkv-chunked" or is_prompt)
            voters = min(w, L) if policy == "snapkv-chunked" and compact else 0
        cache.begin(start, L, need_probs=policy == "h2o" or voters > 0, vote_queries=voters)
        ids = torch.tensor([tokens[start:start + L]], device=dev)
        out = model(ids, torch.zeros_like(ids), cache)[0]                               # (L, V)；位置见 attend
        logits.append(out.float().cpu())
        cache.kept[:, :, start:start + L] = True
        n = start + L
        if policy in ("h2o", "snapkv") and cache.probs_sum:
            scores[:, :, :n] += torch.stack(cache.probs_sum)                            # (layers, H_kv, n)
        if compact:
            compactions += 1
            for layer in range(cfg.num_layers):
                for h in range(cfg.num_kv_heads):
                    idx = cache.kept[layer, h, :n].nonzero()[:, 0]                      # 此刻在缓存里的 token，升序
                    keep, m = select(policy, len(idx), budget, knobs,
                                     scores[layer, h, idx] if policy in ("h2o", "snapkv") else
                                     cache.probs_sum[layer][h, idx] if policy == "snapkv-chunked" else None)
                    margin = min(margin, m)
                    cache.kept[layer, h, :n] = False
                    cache.kept[layer, h, idx[keep.to(dev)]] = True
        kept_after.append(int(cache.kept[0, 0, :n].sum()))
        start = n
        if start >= P:                                                                  # 提示词算完以后每步生成一个
            if len(tokens) - P < max_new_tokens:
                tokens.append(int(out[-1].argmax()))
    return SimResult(torch.cat(logits), tokens[P:], kept_after, compactions, cache.kept.cpu(), margin)


def select(policy: str, n: int, budget: int, knobs: dict, scores: Optional[torch.Tensor]):
    """一个 (层, 头) 的挑选 → (留下的下标, 相对余量)。相对余量 = (留下的最低分 − 扔掉的、分数比它低的最高分) ÷ 留下的
    最低分：很小时引擎（float32 的分数）与这里（float64）可能挑得不同，测试据此区分"近乎平局"与 bug。用相对的：
    概率很小的 token 之间差得再小，相对差也可以很大，float32 照样分得清。分数完全相同（例如最大池化复制出的同一个值）
    不算：两边都先留下标小的。"""
    if policy == "window":
        return keep_window(n, budget), float("inf")
    if policy == "sinks":
        return keep_sinks(n, budget, knobs["num_sinks"]), float("inf")
    recent = knobs["h2o_recent"] if policy == "h2o" else knobs["snapkv_window"]
    scores = scores.cpu()
    if policy != "h2o":
        scores = snapkv_pooled(scores, recent, knobs["snapkv_pool"])
    keep = keep_recent_and_top(scores, budget, recent)
    dropped = torch.ones(n, dtype=torch.bool)
    dropped[keep] = False
    kept_old = keep[keep < n - recent]
    if not len(kept_old) or not dropped.any():
        return keep, float("inf")
    lowest = scores[kept_old].min()
    below = scores[dropped][scores[dropped] < lowest]
    return keep, float((lowest - below.max()) / lowest) if len(below) else float("inf")
