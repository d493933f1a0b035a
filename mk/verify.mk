# `make verify`: re-execute notebooks into build/verify/ (never figures/, never the executed
# notebooks of build/notebooks/) and compare every value of every table they write with the committed
# figures/<table>.csv, within the tolerance each column declares (save_table(..., tolerances=...), recorded
# in the table's provenance record; see fisherkron/repro/tolerance.py). One line per table, then every
# value outside its tolerance; exits non-zero if any. Logic: fisherkron/repro/verify.py.
#   make verify                  every notebook (hours from empty caches: the decoder and GLUE studies)
#   make verify NB=fig_time_algo one notebook (or several: NB="a b")
#   make verify-quick            the notebooks that run in minutes from empty caches (<= 20 min on 2 cores)
#   make verify-stale            the notebooks whose record from this CPU model in VERIFY_RECORD is missing,
#                                did not pass, or was compared with a table committed since (of NB, or all)
#   VERIFY_DATA=fresh|scratch|statistics|shared  empty caches in build/verify/data (default) | the ones the
#                                last verify left there | data/'s calibration statistics, sweeps, task files
#                                and fine-tuned encoders linked in (and the studies' cost measurements copied),
#                                every compression and score recomputed | data/ (reads and may add entries)
#   VERIFY_RECORD=data/verify    where each notebook's result is kept, in a folder per CPU model (committed;
#                                the book's reproduction page shows them); VERIFY_RECORD= keeps none
VERIFY_QUICK   := kronecker_fisher_from_scratch fig_synthetic_correlations fig_time_algo tab_throughput
VERIFY_DATA    ?= fresh
VERIFY_DIR     ?= build/verify
VERIFY_QUICK_BUDGET_S ?= 1200
VERIFY_RECORD  ?= data/verify
NB ?=

.PHONY: verify verify-quick verify-stale
verify: | $(STAMP) ## re-run notebooks into build/verify/ and compare their tables with figures/ within declared tolerances (NB=name for one)
	$(PY) -m fisherkron.repro.verify --scratch $(VERIFY_DIR) --data $(VERIFY_DATA) --nb "$(or $(NB),$(NOTEBOOKS))" \
	  $(if $(VERIFY_RECORD),--record $(VERIFY_RECORD))

verify-quick: | $(STAMP) ## `make verify` for the notebooks that run in minutes from empty caches (<= 20 min on 2 cores)
	$(PY) -m fisherkron.repro.verify --scratch $(VERIFY_DIR) --data $(VERIFY_DATA) --nb "$(VERIFY_QUICK)" \
	  --budget $(VERIFY_QUICK_BUDGET_S) $(if $(VERIFY_RECORD),--record $(VERIFY_RECORD))

verify-stale: | $(STAMP) ## `make verify` for the notebooks whose record is missing, failed or out of date
	$(PY) -m fisherkron.repro.verify --scratch $(VERIFY_DIR) --data $(VERIFY_DATA) --nb "$(or $(NB),$(NOTEBOOKS))" \
	  --stale --record $(or $(VERIFY_RECORD),data/verify)
