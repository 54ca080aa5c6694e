"""HF transformers 作为"不是我们写的"参考实现：step01 的输出必须与它的贪心 generate 逐 token 一致。"""
import torch


def load_hf_model(path, device, dtype):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True).to(device).eval()


@torch.inference_mode()
def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int], ignore_eos: bool = False) -> list[int]:
    """HF 贪心生成的新 token。ignore_eos 时不给 eos（EOS 当普通 token 继续生成），与我们的 --ignore-eos 语义相同。"""
    x = torch.tensor([prompt_ids], device=hf.device)
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                      min_new_tokens=0, eos_token_id=None if ignore_eos else eos_ids,
                      pad_token_id=eos_ids[0] if eos_ids else 0,
                      temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """HF 的 teacher-forcing 前向：(T, V) float32。"""
    return hf(torch.tensor([ids], device=hf.device)).logits[0].float()
