"""非前缀的 K/V 复用：把各段（检索到的文档）单独算好的 K/V 拼成一个请求的 K/V，再决定修多少。

一个 RAG 请求 = [文档 1][文档 2]…[文档 k][问题]。前缀缓存（step06）只能复用从位置 0 起完全相同的 token；
文档换个顺序，前缀就不同了。块缓存（chunk_cache.py）按内容存每篇文档单独算出的 K/V（位置 0..n−1），
拼起来有两处不对：

1. 位置：文档 j 现在从位置 o_j 开始，存着的 K 却是按 0..n−1 旋转的。RoPE 只依赖相对距离：
   R(p + Δ) = R(Δ)·R(p)，所以把存着的 K 再转 Δ = o_j 就和在 o_j.. 处算的一模一样（rerotate；V 不转）。
   前提是"同一段在 o_j 处单独算"——文档前面没有别的文本。
2. 跨段注意力：文档 j 的每个 token 从没看过它前面的文档 1..j−1，它在第 1 层以后的隐藏状态、K、V 都和
   完整 prefill 里的不一样。这一处没法靠旋转修，只能重算。

模式（BLEND_MODES；none / prefix 不走这里，就是 step12 的引擎）：
    concat  段的 K/V 原样拼上，位置不修（错的那种：量一量错多少）
    reuse   K 转到新位置，什么也不重算（只算问题部分）
    blend   CacheBlend（Yao et al., EuroSys '25）：先照完整 prefill 算第 0 层（全部 token），在检查层（第 1 层）
            比较每个复用 token 新算的 K 与复用的 K，偏差最大的 r（recompute_ratio）那部分 + 问题部分一起，
            逐层重算全部层（每个 token 在自己的位置上、因果掩码），它们新算的 K/V 盖掉复用的（只在这个请求里；
            存着的段不变，仍与位置无关）。r = 0 与 reuse 逐位相同，r = 1 就是完整 prefill。

偏差用哪个：LMCache 的 blender 比较 RoPE 之后的 K（float32 的平方 L2），CacheBlend 原始代码（vllm_blend）比较 V。
我们默认用 K（deviation_on="k"，同 LMCache），"v" 也可选（EngineConfig.deviation_on）。只选一个检查层（两者的默认
check_layers=[1]），没有论文里"逐层缩小"的 gradual filtering。

代价（blend_cost）按"走完全部层的 token 数"折算：重算的 token 各 1 个，检查段（全部 n 个 token 走前 CHECK_LAYER 层）
⌈n·CHECK_LAYER / L⌉ 个（检查层那几个投影不另算）。一个也不选时（r = 0，或 r × 复用数不到 1）不跑检查段。

blend_prefill 是一个手写的逐层前向：一个请求、连续的 (layers, 2, H_kv, n, D) K/V，不碰分页池子——引擎（engine.py）
负责把段的 K/V 从池子里读出来、把结果写进请求自己的块。形状记号见 common/shapes.py。
"""
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch
import torch.nn.functional as F

from common.errors import UserError
from common.model import apply_rope

from . import eviction

BLEND_MODES = ("concat", "reuse", "blend")      # 走 blend_prefill 的模式
ALL_MODES = ("none", "prefix") + BLEND_MODES      # --blend 的全部取值
CHECK_LAYER = 1                                   # 在哪一层选重算的 token（CacheBlend、LMCache 的默认）
DEVIATIONS = ("k", "v")                           # 检查层比较哪一个：K（LMCache 的默认）/ V（CacheBlend 的 vllm_blend）


# ---- 位置：RoPE 的再旋转 ----
def rerotate(k: torch.Tensor, delta, model) -> torch.Tensor:
    """k (..., n, D)：已按位置 p 旋转过的 K → 按 p + delta 旋转的 K。delta 是整数或 (n,) 的张量。
    R(p + Δ) = R(Δ)·R(p)：每对分量 (x_i, x_{i+D/2}) 再转角度 Δ·θ_i，与 apply_rope 同一个公式，只是角度换成 Δ。
    在 float32 里转，再回到 k 的 dtype。linear / llama3 缩放只改 θ_i，仍是纯旋转，公式照样成立。"""
    n = k.shape[-2]
    delta = torch.as_tensor(delta, device=k.device).expand(n)                    # (n,)
    return eviction.rerotate(k, delta, model.rope.inv_freq)                      # 与压紧时同一个旋转：(..., n, D)


# ---- 段的 K/V：单独算（位置 start..start+n−1，前面什么也没有）----
class _Capture:
    """common/kv_cache.py 接口的最小实现：记下每层的 K/V，注意力就是本次前向自己的因果注意力。"""
    mask = None

    def __init__(self, num_layers: int):
        self.kv: list[Optional[torch.Tensor]] = [None] * num_layers

    def attend(self, layer_idx, q, k, v):
        self.kv[layer_idx] = torch.stack((k[0], v[0]))                           # (2, H_kv, n, D)
        return attend(q, k, v)


@torch.inference_mode()
def chunk_kv(model, token_ids: list[int], start: int = 0) -> torch.Tensor:
    """一段单独做 prefill（位置 start..start+n−1）→ 每层的 K/V (layers, 2, H_kv, n, D)。块缓存存 start = 0 的。"""
    n, dev = len(token_ids), model.device
    ids = torch.tensor([token_ids], device=dev)                                  # (1, n)
    positions = torch.arange(start, start + n, device=dev)[None]                 # (1, n)
    cap = _Capture(model.cfg.num_layers)
    model(ids, positions, cap, last_only=True)
    return torch.stack(cap.kv)                                                   # (layers, 2, H_kv, n, D)


# ---- 手写的逐层前向 ----
def layer_qkv(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """一层的 q、k、v（k 已做 RoPE），与 common/model.py 的 Attention.forward 前半段相同。
    x (1, m, E)，cos/sin (1, m, D) → q (1, H, m, D)，k、v (1, H_kv, m, D)。"""
    attn, m = layer.self_attn, x.shape[1]
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(1, m, attn.H, attn.D)
    k = attn.k_proj(h).view(1, m, attn.H_kv, attn.D)
    v = attn.v_proj(h).view(1, m, attn.H_kv, attn.D)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)           # (1, heads, m, D)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """common/model.py 的 attention 同一个算式（GQA 不复制 K/V，mask 里 True = 可以看，None = 因果），换成 PyTorch 融合的
    scaled_dot_product_attention：它不把 (H, m, n) 的分数整个写出来再 masked_fill、softmax。朴素的那个在 n 上千时
    占了这个前向的大头（1,422 个 token、r = 1：注意力 9.5 s / 整个 13.9 s）；融合之后整个前向 5.1 s，差在 1e-6。
    q (1, H, m, D)，k/v (1, H_kv, n, D) → (1, H, m, D)。每个 query 至少看得到位置 0，没有整行被遮住的情况。"""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


def layer_rest(layer, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """一层注意力之后的部分：o_proj + 残差，再 MLP + 残差。x (1, m, E)，out (1, H, m, D) → (1, m, E)。"""
    attn, m = layer.self_attn, x.shape[1]
    x = x + attn.o_proj(out.transpose(1, 2).reshape(1, m, attn.H * attn.D))                 # (1, m, E)
    return x + layer.mlp(layer.post_attention_layernorm(x))


@dataclass
class BlendResult:
    kv: torch.Tensor                  # (layers, 2, H_kv, n, D)：这个请求的 K/V（复用的 + 重算的）
    selected: torch.Tensor            # (n,) bool：走完全部层重算的 token（问题部分 + 选中的）
    logits: Optional[torch.Tensor]    # (V,)：最后一个 token 的 logits（它被重算时；否则 None）
    probe_tokens: int                 # 为选择而算了前 CHECK_LAYER 层（和检查层的 K/V 投影）的 token 数
    recomputed_tokens: int            # selected 的个数
    all_logits: Optional[torch.Tensor] = None   # (m, V)：每个重算的 token 的 logits（all_logits=True 时；按位置升序）


def check_ratio(ratio) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise UserError(f"recompute_ratio must be in [0, 1], got {ratio!r}")
    return float(ratio)


def num_to_select(ratio: float, num_reused: int) -> int:
    """复用的 token 里选几个重算：⌊r × 复用数⌋（问题部分另外总要重算；LMCache 的 int(total_len * recomp_ratio) 乘的是全部
    token），r 按写出来的十进制算——二进制浮点里 0.29 × 100 = 28.999999999999996，直接 int() 会少选一个。r = 1 时全选。"""
    return math.floor(Fraction(repr(ratio)) * num_reused)


def blend_cost(n: int, num_reused: int, mode: str, ratio: float, num_layers: int) -> int:
    """blend_prefill 算掉多少，折算成走完全部层的 token 数：重算的（没有可复用 K/V 的 + 选中的）各 1 个，
    检查段 ⌈n·CHECK_LAYER / L⌉ 个（只在真的要选时跑）。n 个 token 里 num_reused 个有复用的 K/V。"""
    top = num_to_select(ratio, num_reused) if mode == "blend" else 0
    probe = -(-n * CHECK_LAYER // num_layers) if top else 0
    return n - num_reused + top + probe


@torch.inference_mode()
def blend_prefill(model, token_ids: list[int], cached_kv: torch.Tensor, reused: torch.Tensor, mode: str,
                  ratio: float = 0.0, deviation_on: str = "k", all_logits: bool = False) -> BlendResult:
    """一个请求的 prefill，位置 0..n−1。cached_kv (layers, 2, H_kv, n, D)：reused[i] 为 True 的 token 在这里放着
    复用来的 K/V（concat：段存着的原样；reuse / blend：已转到新位置）；其余 token（问题、段之间的文字）的那几列不读。
    返回这个请求完整的 K/V 与最后一个 token 的 logits；all_logits：每个重算的 token 的 logits（章节模式拿问题之后的
    答案位置做 teacher forcing：它们在问题部分里，总被重算）。"""
    if mode not in BLEND_MODES:
        raise ValueError(f"mode must be one of {BLEND_MODES}, got {mode!r}")
    if deviation_on not in DEVIATIONS:
        raise ValueError(f"deviation_on must be one of {DEVIATIONS}, got {deviation_on!r}")
    ratio = check_ratio(ratio)
    n, dev, layers = len(token_ids), model.device, model.layers
    ids = torch.tensor([token_ids], device=dev)                                  # (1, n)
    cos, sin = model.rope(torch.arange(n, device=dev)[None], model.dtype)        # 各 (1, n, D)
    kv = cached_kv.clone()                                                       # (layers, 2, H_kv, n, D)
    reused = reused.to(dev)
    selected = ~reused                                                           # 问题部分总要重算
    probe = 0

    # 1) 选谁重算（只有 blend）：照完整 prefill 算检查层之前的层（全部 token），在检查层比较新算的 K（或 V）
    #    与复用的：每个 token 一个偏差 = Σ_头 Σ_维 (新 − 旧)²。第 0 层的 K/V 只依赖 token 自己和位置，
    #    转过位置之后与复用的相同，看不出谁受了前文影响，所以检查层是 1。一个也不选（r = 0）就不必算
    top = num_to_select(ratio, int(reused.sum())) if mode == "blend" else 0
    if top:
        x = model.embed_tokens(ids)                                              # (1, n, E)
        for layer in layers[:CHECK_LAYER]:
            x = layer_rest(layer, x, attend(*layer_qkv(layer, x, cos, sin)))    # 没有缓存：普通的因果注意力
        _, k_new, v_new = layer_qkv(layers[CHECK_LAYER], x, cos, sin)            # 各 (1, H_kv, n, D)
        new = (k_new if deviation_on == "k" else v_new)[0].float()               # (H_kv, n, D)
        old = kv[CHECK_LAYER, 0 if deviation_on == "k" else 1].float()           # (H_kv, n, D)
        dev_score = ((new - old) ** 2).sum(dim=(0, 2))                           # (n,)
        dev_score[~reused] = -math.inf                                           # 只在复用的 token 里选
        selected[dev_score.topk(top).indices] = True
        probe = n

    # 2) 选中的 token 逐层重算：每层先算它们的 q、k、v，新 K/V 盖掉这一层里它们那几列，再让它们的 query 看这一层
    #    的全部 n 个 key（没选中的是复用的，选中的是刚算的），按各自的位置做因果掩码
    idx = selected.nonzero()[:, 0]                                               # (m,) 升序
    m = len(idx)
    logits, x = None, None
    if m:
        x = model.embed_tokens(ids[:, idx])                                      # (1, m, E)
        cos_s, sin_s = cos[:, idx], sin[:, idx]                                  # (1, m, D)
        mask = torch.arange(n, device=dev)[None, :] <= idx[:, None]              # (m, n)：key 位置 ≤ query 位置
        for l, layer in enumerate(layers):
            q, k, v = layer_qkv(layer, x, cos_s, sin_s)                          # (1, H, m, D), (1, H_kv, m, D)
            kv[l, 0][:, idx], kv[l, 1][:, idx] = k[0], v[0]                      # 新的盖掉复用的（只在这个请求里）
            x = layer_rest(layer, x, attend(q, kv[l, 0][None], kv[l, 1][None], mask))   # (1, m, E)
        if idx[-1] == n - 1:
            logits = model.lm_head(model.norm(x[:, -1:])).float()[0, 0]         # (V,)
    rows = model.lm_head(model.norm(x)).float()[0] if m and all_logits else None          # (m, V)
    return BlendResult(kv, selected.cpu(), logits, probe, m, rows)


# ---- 从块缓存拼出一个请求的复用 K/V ----
def chunks_before(token_ids: list[int], chunks: list[tuple[int, int]], n: int) -> list[tuple[int, int, tuple]]:
    """提示词前 n 个 token 里的段：(start, end, 段的全部 token)。段整段查、整段存（key 是它全部的 token），
    最后一个提示词 token 落在段里时只用到它之前。"""
    return [(start, end, tuple(token_ids[start:end])) for start, end in chunks if start < n]


def reuse_cost(store, token_ids: list[int], chunks: list[tuple[int, int]], n: int) -> tuple[int, int]:
    """reuse_chunks 会单独算几个 token（块缓存里没有的段，一个请求里重复的段只算一次），前 n 个 token 里
    几个有复用的 K/V。只看不动：不 acquire、不记命中。"""
    pieces = chunks_before(token_ids, chunks, n)
    missing = sum(len(ids) for ids in {ids for _, _, ids in pieces} if not store.contains(ids))
    return missing, sum(min(end, n) - start for start, end, _ in pieces)


@torch.inference_mode()
def reuse_chunks(model, store, token_ids: list[int], chunks: list[tuple[int, int]], mode: str, n: int):
    """提示词的前 n 个 token 里，各段的 K/V：块缓存里有就拿（acquire），没有就单独算一遍（位置 0..）、存进去
    （池子腾不出块就不存，照样用）。先把命中的段全部 acquire、再算没命中的：存新段要腾块时回收不到这个请求要用的段，
    单独算的 token 数正好是 reuse_cost 事先报的。concat：原样放到段的位置；reuse / blend：K 再转 Δ = start（V 不变）。
    返回 (kv (layers, 2, H_kv, n, D)，reused (n,) bool，持有的段（用完要 store.release），单独算了几个 token)。"""
    cfg, dev = model.cfg, model.device
    kv = torch.zeros(cfg.num_layers, 2, cfg.num_kv_heads, n, cfg.head_dim, device=dev, dtype=model.dtype)
    reused = torch.zeros(n, dtype=torch.bool)
    pieces = chunks_before(token_ids, chunks, n)
    got: dict[tuple, torch.Tensor] = {}                # 段的 token → 它存着（或刚算出）的 K/V (layers, 2, H_kv, len, D)
    held, computed = [], 0
    try:
        for _, _, ids in pieces:
            if ids not in got and (entry := store.lookup(ids)) is not None:
                held.append(entry)
                got[ids] = store.read(entry)
        for _, _, ids in pieces:
            if ids not in got:
                got[ids] = chunk_kv(model, list(ids))
                computed += len(ids)
                entry = store.put(ids, got[ids])
                if entry is not None:
                    held.append(entry)
        for start, end, ids in pieces:
            m = min(end, n) - start
            c = got[ids][:, :, :, :m]
            if mode != "concat":
                c = torch.stack((rerotate(c[:, 0], start, model), c[:, 1]), dim=1)
            kv[:, :, :, start:start + m], reused[start:start + m] = c, True
    except BaseException:
        for e in held:
            store.release(e)
        raise
    return kv, reused, held, computed


# ---- 段的标记 ----
def check_chunks(chunks, num_tokens: int, field: str = "chunks") -> list[tuple[int, int]]:
    """chunks：提示词里各段的 [start, end)（token 下标），按位置排好、互不重叠、非空、都在提示词之内。
    不合法的抛 UserError，说出是哪个字段。"""
    out, prev_end = [], 0
    for i, c in enumerate(chunks):
        try:
            start, end = (int(x) for x in c)
        except (TypeError, ValueError):
            raise UserError(f"{field}[{i}] must be a pair (start, end), got {c!r}") from None
        if not 0 <= start < end:
            raise UserError(f"{field}[{i}] = ({start}, {end}) must satisfy 0 <= start < end")
        if end > num_tokens:
            raise UserError(f"{field}[{i}] = ({start}, {end}) is longer than the prompt ({num_tokens} tokens)")
        if start < prev_end:
            raise UserError(f"{field}[{i}] = ({start}, {end}) overlaps or precedes {field}[{i - 1}] "
                            f"(chunks must be in order and must not overlap)")
        out.append((start, end))
        prev_end = end
    return out


def check_model(model) -> None:
    """blend 能服务的模型：至少 2 层（检查层是第 1 层）、每层全注意力（滑动窗口的层 blend_prefill 不加窗口掩码）。
    池子必须是模型的 dtype（量化的池子存的是码，转不了位置）由 EngineConfig.validate 查。"""
    cfg = model.cfg
    if cfg.num_layers <= CHECK_LAYER:
        raise UserError(f"--blend needs a model with more than {CHECK_LAYER} layer(s) "
                        f"(the check layer is layer {CHECK_LAYER}); this one has {cfg.num_layers}")
    if any(w is not None for w in getattr(cfg, "layer_windows", ()) or ()):
        raise UserError("--blend does not serve sliding-window models (its forward has no window mask)")
