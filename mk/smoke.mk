# `make smoke`: every notebook with tiny parameters (notebooks/params/<name>.smoke.yaml),
# outputs in build/smoke/ (figures/ is never touched). `make test` (and so CI) runs it.
SMOKE_BUDGET_S ?= 480

.PHONY: smoke
smoke: | $(STAMP) ## run every notebook with tiny parameters into build/smoke/ (about 8 min on 2 cores from empty caches)
	@rm -rf build/smoke build/notebooks/smoke
	@start=$$SECONDS; \
	$(MAKE) --no-print-directory PROFILE=smoke notebooks; \
	took=$$((SECONDS - start)); \
	echo "[smoke] all notebooks ran in $$took s (budget $(SMOKE_BUDGET_S) s)"; \
	if [ $$took -gt $(SMOKE_BUDGET_S) ]; then echo "[smoke] WARNING: over the $(SMOKE_BUDGET_S) s budget" >&2; fi
