"""分词器与对话模板：不是本课的重点，直接用 transformers（只读本地文件）。"""
from pathlib import Path

from transformers import AutoTokenizer

from .config import eos_token_ids
from .errors import UserError


class Tokenizer:
    def __init__(self, path):
        try:
            self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise UserError(f"cannot load tokenizer from {path}: {e}") from None
        self.eos_ids = eos_token_ids(Path(path))  # 与 HF generate 相同的停止 token

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if not text:
            raise UserError("empty prompt")
        if chat:
            if not self.hf.chat_template:
                raise UserError("--chat: this tokenizer has no chat template")
            text = self.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
            return self.hf(text, add_special_tokens=False).input_ids  # 模板里已经有特殊 token
        ids = self.hf(text).input_ids
        if not ids:
            raise UserError("prompt encodes to zero tokens")
        return ids

    def decode(self, ids) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)
