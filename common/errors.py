class UserError(Exception):
    """用户输入有误（提示词、参数、模型目录……）。run.py 把它打印成一行 `error: ...` 并以状态码 2 退出。"""
