# `make smoke`: every notebook with tiny parameters (notebooks/params/<name>.smoke.yaml),
# outputs in build/smoke/ (figures/ is never touched). `make test` (and so CI) runs it beside pytest.
# Notebooks run SMOKE_JOBS at a time (one kernel keeps about 0.7 of two cores busy), the longest first so
# that none starts last; under `make test` they share its TEST_JOBS job slots with pytest instead. Two
# notebooks that need the same calibration entry collect it once: the second waits for the first. A run
# longer than SMOKE_BUDGET_S seconds fails. The target is `make test` within 10 minutes on 2 cores, and the
# smoke run is what ends last: 459 s beside pytest on an idle 2-core AMD EPYC once, but 676 s and 716 s in two
# fresh clones (pytest 538 s and 571 s beside it) on an idle 2-core AMD EPYC with AVX2 only, from empty caches,
# and 730 s there before the changes of that measurement; CI's machine ran that older set in 778 s. After the
# repository's tools stopped importing torch (one process per notebook): 666 s there (pytest 536 s beside it). The test
# suite of the 459 s measurement takes 586 s alone on the AVX2 machine: the machines differ, not the tests. The budget
# is set above the slower machines so that it catches a regression there instead of failing every run; on
# those machines `make test` misses the 10-minute target.
SMOKE_BUDGET_S ?= 840
SMOKE_JOBS ?= 2
TEST_JOBS ?= 2
# OpenMP threads per process under `make test`: its job slots already fill the cores (pytest beside a notebook,
# the determinism test's two runs side by side), and one thread each spends less CPU than two threads each
# contending for the same cores. Measured back to back on the idle 2-core AVX2 AMD EPYC, fresh clone, empty caches:
# `make test` 686 s and 1,298 CPU s with torch's default two threads per process, 616 s and 1,146 CPU s with one
# (two earlier pairs: 659 / 617 s; the same run varies by about 5 % between hours on this machine).
TEST_THREADS ?= 1
# the notebooks whose smoke run takes longest, longest first (each one's "[notebook] NAME took N s"); the others
# take 30-45 s, so the run ends on short ones
SMOKE_LONGEST := tab_extra_compression_results tab_llm_compression_main fig_allocation_cost fig_calibration fig_scale \
  kronecker_fisher_from_scratch fig_rank_allocation
# the notebooks tests/test_determinism.py executes twice from empty caches with the smoke parameters: `make test`
# runs pytest beside the smoke run and leaves them out of it (SMOKE_SKIP), a third run of each would add nothing
SMOKE_TWICE := fig_synthetic_correlations fig_time_algo
SMOKE_SKIP ?=

.PHONY: smoke
smoke: | $(STAMP) ## run every notebook with tiny parameters into build/smoke/ (fails over SMOKE_BUDGET_S, 840 s)
	@rm -rf build/smoke build/notebooks/smoke
	@start=$$SECONDS; \
	$(MAKE) --no-print-directory $(if $(findstring jobserver,$(MAKEFLAGS)),,-j$(SMOKE_JOBS)) --output-sync=target \
	  PROFILE=smoke $(filter-out $(SMOKE_SKIP),$(filter $(NOTEBOOKS),$(SMOKE_LONGEST)) $(filter-out $(SMOKE_LONGEST),$(NOTEBOOKS))) \
	  || exit $$?; \
	took=$$((SECONDS - start)); \
	$(if $(SMOKE_SKIP),echo "[smoke] left out (the tests run them): $(SMOKE_SKIP)";) \
	echo "[smoke] all notebooks ran in $$took s (budget $(SMOKE_BUDGET_S) s)"; \
	if [ $$took -gt $(SMOKE_BUDGET_S) ]; then \
	  echo "[smoke] over the $(SMOKE_BUDGET_S) s budget: the slow notebooks are in build/smoke/figures/*.provenance.json (wall_seconds, phases)" >&2; \
	  exit 1; fi
