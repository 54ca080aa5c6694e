"""全仓库统一的形状记号（每个 reshape / matmul 旁的注释都用它们）。

    B           batch 大小（一次前向里的请求数）
    L           本次前向的 query 长度（prefill: 提示词长度；decode: 1）
    S           key/value 长度（= 已缓存的长度 + L）
    E           hidden_size
    F           intermediate_size（SwiGLU 中间维度）
    V           词表大小
    H           query 头数
    H_kv        key/value 头数（GQA: 每 G = H / H_kv 个 query 头共享一个 KV 头）
    D           head_dim
    num_blocks  分页 KV 池中的块数（step05）
    block_size  每块容纳的 token 数（step05）
"""
