# The two commands: `make run` and `make test`. Everything else is a helper for them.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test install migrate clean

$(STAMP): requirements.txt requirements-nodeps.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

install: $(STAMP)

migrate: install
	$(PY) manage.py migrate --noinput

run: migrate
	$(PY) manage.py seed_demo
	$(PY) manage.py load_docs
	$(PY) manage.py runstack $(RUN_ARGS)

# The suite runs against PostgreSQL and Redis on 127.0.0.1 (.ci/run starts them when absent).
test: install
	$(VENV)/bin/ruff check .
	DATABASE_URL=$${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/ceiling} \
	REDIS_URL=$${TEST_REDIS_URL:-redis://127.0.0.1:6379/15} \
	CEILING_COMPILE_DECODE=$${CEILING_COMPILE_DECODE:-0} \
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var/
