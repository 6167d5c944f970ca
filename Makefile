# make test / make demo create .venv and install what they need.
# TORCH is the pip spec for PyTorch (CI passes torch==2.13.0, the CPU build on disk).
TORCH ?= torch
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(subst /,_,$(subst =,_,$(TORCH)))

.PHONY: test demo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test,demo]"
	rm -f $(VENV)/.installed-*
	touch $@

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

clean:
	rm -rf $(VENV) build *.egg-info
