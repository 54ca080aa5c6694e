"""按内容寻址的块缓存（chunk cache）：一段文本（一篇检索到的文档）的 K/V 只算一次，之后放在任何位置都能拿来用。

前缀缓存（step06）的 key 是链式的：hash(前一块的 key, 这一块的 token)——同样的 token 前面换了内容，key 就不同，
因为它们的 K/V 确实不同（每个 token 的隐藏状态看过前面的全部文本）。块缓存故意不这么做：key 只看这一段自己的 token，

    chunk_key(token_ids) = hash(("chunk", token_ids))        与它在提示词里的位置、前面是什么都无关

存的 K/V 是这一段**单独**算出来的（位置 0..n−1，前面什么也没有：CacheBlend / LMCache 预先算文档 K/V 的做法），
所以拿来用时是近似的：位置要转（blend.py 的 rerotate），跨文档的注意力要补（blend.py 的选择性重算）。

它住在同一个分页池子里，用的是前缀缓存的那套引用计数和 LRU（block_manager.py）：
- 一段占 ceil(n / block_size) 块，每块作为一个"缓存块"登记在 BlockManager.cached / key_to_block 里
  （key = hash(("chunk", 段的 key, 块序号))，原像里记着这一块的 token，最后一块可以不满）；
- 正在用它的请求（acquire 到 release 之间）每个持一份引用：ref ≥ 1 的块不会被回收；
- 没人用时引用为 0，块进 BlockManager.evictable，与没人用的前缀块排在同一条 LRU 里：池子不够时
  allocate 从最久没用的开始回收（不论是前缀块还是段块）。段里任何一块被回收，这一段就失效：下次查到时
  把剩下的块也还给空闲链表（lookup 里核对每一块的原像，同 match_prefix 的做法）；每次存新段时也把失效的段全部忘掉，
  所以 entries 里只有完整的段（每段至少占一块），条目数不超过池子的块数——服务器一直跑也不会越积越多。

KV 的读写按"槽"：段里第 s 个 token 在 blocks[s // bs] 的第 s % bs 个位置；池子的布局同 kv_cache.py：
(layers, 2, num_blocks + 1, H_kv, block_size, D)。

段怎么标出来（文件末尾的 split_prompt / build_prompt；run.py 的 --doc / --chunk-sep 与第 11 章服务器的
chunk_separator 字段共用，所以同一段文本在两边分出同样的 token 与段）：每段单独分词、首尾相接，最后是问题。
"""
from dataclasses import dataclass
from typing import Optional

import torch

from common.errors import UserError

from .block_manager import BlockManager, CachedBlock


def chunk_key(token_ids) -> int:
    """段的 key：只看它自己的 token（与位置无关）。整数元组的 hash 跨进程稳定（见 block_manager.chain_hash）；
    命中时核对 token，碰撞只会变成未命中。"""
    return hash(("chunk", tuple(token_ids)))


@dataclass
class ChunkEntry:
    key: int
    token_ids: tuple[int, ...]
    blocks: list[int]                 # 物理块，按顺序；段里第 s 个 token 在 blocks[s // bs] 的第 s % bs 个槽
    records: list[CachedBlock]        # 每块登记在 BlockManager.cached 里的原像（核对"这块还是我的"用）
    users: int = 0                    # 正在用它的请求数（acquire − release）


def slot_index(blocks: list[int], n: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """前 n 个槽的 (物理块号, 块内偏移)，各 (n,)。"""
    s = torch.arange(n)
    b = torch.tensor(blocks, dtype=torch.long)[s // block_size]
    return b.to(device), (s % block_size).to(device)


def read_kv(pool: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    """池子里按块表存的前 n 个 token 的 K/V → (layers, 2, H_kv, n, D)（一份拷贝）。"""
    b, off = slot_index(blocks, n, pool.shape[4], pool.device)
    # pool[:, :, b, :, off]：两个下标张量被一个切片隔开，高级索引的维度 n 排到最前：(n, layers, 2, H_kv, D)
    return pool[:, :, b, :, off].permute(1, 2, 3, 0, 4)


def write_kv(pool: torch.Tensor, blocks: list[int], kv: torch.Tensor) -> None:
    """kv (layers, 2, H_kv, n, D) → 写进块表 blocks 的前 n 个槽。"""
    n = kv.shape[3]
    b, off = slot_index(blocks, n, pool.shape[4], pool.device)
    pool[:, :, b, :, off] = kv.permute(3, 0, 1, 2, 4).to(pool.dtype)      # (n, layers, 2, H_kv, D)


class ChunkStore:
    """段 key → 池子里的块。put / lookup 得到的段都已被调用方 acquire（引用 +1），用完必须 release。"""

    def __init__(self, block_manager: BlockManager, pool: torch.Tensor):
        self.bm, self.pool = block_manager, pool
        self.entries: dict[int, ChunkEntry] = {}
        self.hits = self.misses = self.stored = 0

    def __len__(self) -> int:
        return len(self.entries)

    def _valid(self, e: ChunkEntry) -> bool:
        """段的每一块都还登记着我们的原像（没有被回收后另作他用）。"""
        return all(self.bm.cached.get(b) is r for b, r in zip(e.blocks, e.records))

    def _forget(self, e: ChunkEntry) -> None:
        """失效的段：还登记着、没人用的块直接回空闲链表（不必等 LRU 轮到它们）。"""
        del self.entries[e.key]
        for b, r in zip(e.blocks, e.records):
            if self.bm.cached.get(b) is r and self.bm.ref_counts[b] == 0:
                del self.bm.evictable[b]
                del self.bm.key_to_block[r.key]
                del self.bm.cached[b]
                self.bm.free_blocks.append(b)

    def contains(self, token_ids) -> bool:
        """有没有这一段（还完整地在池子里）。只看不动：不 acquire、不记命中（引擎接纳前估代价用）。"""
        token_ids = tuple(token_ids)
        e = self.entries.get(chunk_key(token_ids))
        return e is not None and e.token_ids == token_ids and self._valid(e)

    def lookup(self, token_ids) -> Optional[ChunkEntry]:
        """命中：acquire 它（每块引用 +1，没人用的从 evictable 取出）并返回；没有或已失效：None。"""
        token_ids = tuple(token_ids)
        e = self.entries.get(chunk_key(token_ids))
        if e is not None and (e.token_ids != token_ids or not self._valid(e)):
            if e.token_ids == token_ids:
                self._forget(e)
            e = None
        if e is None:
            self.misses += 1
            return None
        self.hits += 1
        self.acquire(e)
        return e

    def acquire(self, e: ChunkEntry) -> None:
        for b in e.blocks:
            if self.bm.ref_counts[b] == 0:
                del self.bm.evictable[b]
            self.bm.ref_counts[b] += 1
        e.users += 1

    def release(self, e: ChunkEntry) -> None:
        """不再用：引用 −1；到 0 的块回到 evictable 的末尾（最近用过），池子不够时按 LRU 被回收。"""
        if e.users <= 0:
            raise RuntimeError(f"release of a chunk nobody holds ({len(e.token_ids)} tokens)")
        e.users -= 1
        self.bm.free(e.blocks)

    def put(self, token_ids, kv: torch.Tensor) -> Optional[ChunkEntry]:
        """存一段：kv (layers, 2, H_kv, n, D) 是它单独算出的 K/V（位置 0..n−1）。池子腾不出块（没人用的缓存块都回收了
        还不够）时不存，返回 None——调用方照样用手上这份 K/V，只是下次还要再算。已有同样的段时返回那一段。
        返回的段已被 acquire。"""
        token_ids = tuple(token_ids)
        old = self.lookup(token_ids)
        if old is not None:
            return old
        self.misses -= 1                                 # 上面那次 lookup 不算一次未命中（调用方已经算过）
        n_blocks = self.bm.blocks_for(len(token_ids))
        if not self.bm.can_allocate(n_blocks):
            return None
        key, bs = chunk_key(token_ids), self.bm.block_size
        keys = [hash(("chunk", key, i)) for i in range(n_blocks)]
        if any(k in self.bm.key_to_block for k in keys):  # 64 位 hash 碰撞（几乎不会）：不存
            return None
        blocks = self.bm.allocate(n_blocks)              # 引用 1 = 存它的这个请求在用；可能回收别的段 / 前缀块
        write_kv(self.pool, blocks, kv)
        records = [CachedBlock(k, blocks[i - 1] if i else None, token_ids[i * bs:(i + 1) * bs])
                   for i, k in enumerate(keys)]
        for b, r in zip(blocks, records):                # 登记成缓存块：没人用时进 evictable，与前缀块同一条 LRU
            self.bm.cached[b], self.bm.key_to_block[r.key] = r, b
        e = ChunkEntry(key, token_ids, blocks, records, users=1)
        self.entries[key] = e
        self.stored += 1
        self._prune()                                    # 这次分块（和之前请求要块时）回收掉的段
        return e

    def _prune(self) -> None:
        """忘掉失效的段（有块被 LRU 回收了）：之后 entries 里每段都还完整地占着池子里的块。"""
        for e in [e for e in self.entries.values() if not self._valid(e)]:
            self._forget(e)

    def read(self, e: ChunkEntry) -> torch.Tensor:
        """段存着的 K/V → (layers, 2, H_kv, n, D)（位置 0..n−1 的旋转）。"""
        return read_kv(self.pool, e.blocks, len(e.token_ids))


# ---------------- 段的标记：文本 → token id 与各段的 [start, end) ----------------
CHAT_SLOT = "\x00CHUNKS\x00"   # 对话模板里"用户消息"的位置：模板在它前后的部分各自分词


def split_prompt(prompt: str, sep: str, names: tuple[str, str] = ("--prompt", "--chunk-sep")) -> list[str]:
    """LMCache 的做法（它的 blend_special_str，默认 " # # "）：在分隔符处切开，前面每片一段，最后一片是问题；
    都不能是空的，分隔符本身不进提示词。names：报错时怎么称呼提示词与分隔符（run.py 的参数名 / 服务器的字段名）。"""
    parts = prompt.split(sep)
    if len(parts) < 2 or not all(parts):
        raise UserError(f"{names[0]} {prompt[:40]!r}: {names[1]} {sep!r} must split it into "
                        "non-empty chunks followed by a non-empty question")
    return parts


def piece_ids(tok, text: str) -> list[int]:
    ids = tok.hf(text, add_special_tokens=False).input_ids
    if not ids:
        raise UserError(f"a chunk encodes to zero tokens: {text[:40]!r}")
    return ids


def build_prompt(tok, docs: list[str], question: str, chat: bool) -> tuple[list[int], list[tuple[int, int]]]:
    """文档各自分词（不加特殊 token）、首尾相接，再接问题 → (token id, 各段的 [start, end))。
    chat：对话模板的开头在第一段前、结尾在问题后。tok：common.tokenizer.Tokenizer。"""
    head, tail = "", ""
    if chat:
        if not tok.hf.chat_template:
            raise UserError("--chat: this tokenizer has no chat template")
        rendered = tok.hf.apply_chat_template([{"role": "user", "content": CHAT_SLOT}], tokenize=False,
                                              add_generation_prompt=True)
        head, tail = rendered.split(CHAT_SLOT)
    ids = tok.hf(head, add_special_tokens=False).input_ids if head else []
    chunks = []
    for d in docs:
        d_ids = piece_ids(tok, d)
        chunks.append((len(ids), len(ids) + len(d_ids)))
        ids += d_ids
    ids += piece_ids(tok, question + tail)
    return ids, chunks
