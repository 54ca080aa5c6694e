"""step13 的章节模式（占位：测量在下一个提交里）。"""
from common import cli


class Chapter:
    def __init__(self, args, s: cli.Session):
        self.args, self.s = args, s

    def run(self) -> bool:
        print("step13_kv_blend：章节模式的测量还没有写（用 --prompt 运行生成模式）")
        return True
