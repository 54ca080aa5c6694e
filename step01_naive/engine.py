"""step01：最朴素的自回归生成。每生成一个 token，都把 *整段* 序列（提示词 + 已生成）重新跑一遍模型。

第 t 步的前向要处理 L + t 个 token，生成 N 个 token 的总工作量 ∝ Σ (L + t) = O(N² + N·L)。
step03 的 KV cache 正是为了消掉这里的重复计算。
"""
import torch


@torch.inference_mode()
def generate(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=(), ignore_eos: bool = False) -> list[int]:
    """贪心生成，返回新 token（遇到 EOS 时包含这个 EOS，与 HF generate 相同）。"""
    ids = list(prompt_ids)
    out = []
    for _ in range(max_new_tokens):
        x = torch.tensor([ids], device=model.device)              # (1, T)：整段序列，每步都从头算
        pos = torch.arange(len(ids), device=model.device)[None]   # (1, T)：位置 0..T-1
        logits = model(x, pos, last_only=True)[0, -1]             # (V,)：只要最后一个位置的下一个 token 分布
        tok = int(logits.argmax())                                # 贪心：取最大的 logit
        ids.append(tok)
        out.append(tok)
        if tok in eos_ids and not ignore_eos:
            break
    return out
