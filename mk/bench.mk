# Issue 5: benchmark of MFF against the authors' svds approach (a benchmark, not a test).
# Outputs: figures/bench/bench_mff.{csv,md,tex,provenance.json}, figures/bench/fig_bench_mff.{png,pdf,provenance.json} and
# figures/bench/bench_minilm_layers.{csv,md,tex,provenance.json}, each written atomically.
BENCH_DIR  ?= figures/bench
BENCH_ARGS ?=

.PHONY: bench bench-quick bench-replot
bench: $(STAMP) ## benchmark MFF vs the authors' svds approach: synthetic sizes, a MiniLM layer, whole MiniLM (about 7 min on 2 idle cores)
	$(PY) -m fisherkron.bench --out $(BENCH_DIR) $(BENCH_ARGS)

bench-replot: $(STAMP) ## redraw figures/bench/fig_bench_mff.{png,pdf} from the tables already there (no timing)
	$(PY) -m fisherkron.bench --replot --out $(BENCH_DIR)

bench-quick: $(STAMP) ## the benchmark on tiny sizes (seconds; checks that it runs)
	$(PY) -m fisherkron.bench --quick --out $(BENCH_DIR)/quick
