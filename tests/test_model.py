"""我们从零写的模型 vs HF transformers 的实现：同样的权重，同样的输入，logits 应当几乎相同。"""
import pytest
import torch

from common.config import ModelConfig
from common.errors import UserError
from common.hf_reference import load_hf_model
from common.model import causal_mask, rope_inv_freq
from common.prompts import CHAPTER_PROMPTS, LONG_PROMPT
from common.weights import load_model
from conftest import make_tiny_model_dir


def _max_diff(ours, hf, ids, positions=None):
    x = torch.tensor([ids])
    pos = torch.arange(len(ids))[None] if positions is None else positions
    with torch.inference_mode():
        a = ours(x, pos)
        b = hf(x, position_ids=pos).logits.float()
    return (a - b).abs().max().item()


def test_tiny_models_match_hf(tiny):
    """llama / qwen2（q/k/v bias）/ qwen3（q/k RMSNorm）三种随机小模型。"""
    hf = load_hf_model(tiny.path, "cpu", torch.float32)
    ids = torch.randint(0, tiny.cfg.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    diff = _max_diff(tiny.model, hf, ids)
    assert diff < 1e-5, f"{tiny.arch}: max |Δlogits| = {diff}"


@pytest.mark.parametrize("kv_heads", [1, 4])
def test_mqa_and_mha_tiny_models_match_hf(tmp_path, kv_heads):
    """H_kv 是训练时定下的结构（config.json 的 num_key_value_heads），不是推理时的开关：4 个 query 头配 1 个 KV 头
    （MQA）或 4 个（MHA）的随机小模型，与 HF 的 logits 一致，k_proj / v_proj 的输出宽度就是 H_kv × D。"""
    path = make_tiny_model_dir(tmp_path, "llama", num_key_value_heads=kv_heads)
    ours, hf = load_model(path, "cpu", torch.float32), load_hf_model(path, "cpu", torch.float32)
    assert ours.cfg.num_kv_heads == kv_heads
    assert hf.model.layers[0].self_attn.k_proj.weight.shape[0] == kv_heads * ours.cfg.head_dim
    assert _max_diff(ours, hf, list(range(2, 40))) < 1e-5


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches_hf(tmp_path, rope):
    """Llama 3.x 默认的 llama3 缩放与 linear 缩放：inv_freq 与 logits 都与 HF 一致。"""
    path = make_tiny_model_dir(tmp_path, "llama", rope_parameters={"rope_theta": 500000.0, **rope})
    ours, hf = load_model(path, "cpu", torch.float32), load_hf_model(path, "cpu", torch.float32)
    assert ours.cfg.rope_scaling["rope_type"] == rope["rope_type"]
    torch.testing.assert_close(rope_inv_freq(ours.cfg), hf.model.rotary_emb.inv_freq.float(), rtol=1e-6, atol=0)
    diff = _max_diff(ours, hf, list(range(2, 200)))  # 超过 original_max_position_embeddings 的位置
    assert diff < 1e-5


def test_real_model_matches_hf(real):
    """真实默认模型：几条提示词（含几百 token 的长提示词）上 logits 的最大绝对误差。
    我们的权重按 (in, out) 存放，矩阵乘的求和顺序与 HF 不同，末位会有差异。在开发机上测得最大 8.2e-5
    （logits 的绝对值最大约 50）；界取 2e-4，给不同 CPU 上 MKL 走不同内核留一点余地。"""
    hf = load_hf_model(real.path, "cpu", torch.float32)
    for name, text, chat in CHAPTER_PROMPTS + [("long", LONG_PROMPT, False)]:
        ids = real.encode(text, chat)
        diff = _max_diff(real.model, hf, ids)
        assert diff < 2e-4, f"{name}: max |Δlogits| = {diff}"


def test_rope_uses_given_positions(tiny):
    """RoPE 只依赖显式传入的位置：把整段序列平移到别的起始位置会改变 logits（位置真的进入了计算），
    而相对位置不变时注意力分数不变 —— 同一段 token 放在位置 100.. 与 0.. 的 logits 几乎相同（RoPE 的相对性）。"""
    ids = torch.tensor([[5, 17, 42, 9, 77, 3]])
    with torch.inference_mode():
        base = tiny.model(ids, torch.arange(6)[None])
        shifted = tiny.model(ids, torch.arange(100, 106)[None])
        scrambled = tiny.model(ids, torch.tensor([[0, 2, 1, 3, 4, 5]]))
    torch.testing.assert_close(base, shifted, rtol=1e-4, atol=1e-4)  # 只有相对位置重要
    assert not torch.allclose(base, scrambled, atol=1e-3)            # 位置错了，结果就错了


def test_last_only_equals_last_position(tiny):
    ids = torch.tensor([[5, 17, 42, 9]])
    pos = torch.arange(4)[None]
    with torch.inference_mode():
        torch.testing.assert_close(tiny.model(ids, pos, last_only=True), tiny.model(ids, pos)[:, -1:])


def test_causal_mask_is_bottom_right_aligned():
    assert causal_mask(3, 3, "cpu").tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # decode：1 个 query 看得到全部 4 个 key；prefill 续接：2 个新 query 接在 2 个已缓存 key 之后
    assert causal_mask(1, 4, "cpu").tolist() == [[True, True, True, True]]
    assert causal_mask(2, 4, "cpu").tolist() == [[True, True, True, False], [True, True, True, True]]


def test_unknown_architecture_is_a_user_error():
    with pytest.raises(UserError, match="unsupported architecture"):
        ModelConfig.from_dict({"model_type": "gpt2", "hidden_size": 8})


def test_cache_attend_default_is_update_then_attention(tiny):
    """common/kv_cache.py 的默认 attend = update + attention(mask)：一个什么都不存、只返回新 K/V 的缓存，
    mask 为 None 时与不传缓存的前向完全相同；换一个掩码（每个位置只看自己），结果随之改变。"""
    from common.kv_cache import KVCache

    class PassThrough(KVCache):
        def __init__(self, mask=None):
            self.mask, self.calls = mask, []

        def update(self, layer_idx, k, v):
            self.calls.append(layer_idx)
            return k, v

    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    pos = torch.arange(6)[None]
    cache = PassThrough()
    assert torch.equal(tiny.model(ids, pos, cache), tiny.model(ids, pos))
    assert cache.calls == list(range(tiny.cfg.num_layers))        # 每层正好一次
    only_self = PassThrough(torch.eye(6, dtype=torch.bool))         # 每个位置只看自己
    assert not torch.allclose(tiny.model(ids, pos, only_self), tiny.model(ids, pos))
