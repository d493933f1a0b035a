# The book: the committed executed notebooks as a static HTML site, and its browser test.
#
# `make book` renders build/book/html/ from committed files only (notebooks/executed/*.ipynb,
# notebooks/*.py, figures/, data/verify/, book/; nothing is executed) with Sphinx and MyST-NB
# (book/conf.py); fisherkron.repro.book writes the Sphinx sources into build/book/src/ first (the
# results page, the notebook pages in the paper's order each opening with its claim and result, the
# guide and the reproduction page with their tables rendered from the records, MathJax 3 copied from
# the django-static-mathjax package, so the site needs no network). Warnings are errors. The site is
# built into html.tmp/ and moved into place. No notebook ever runs (see BOOK_INPUTS).
#
# `make book-test` opens every page in headless Chromium (Debian's chromium; installed with apt-get
# when missing) from a local HTTP server: tests/test_book_browser.py fails on a console error, a
# broken image or link, mathematics left untypeset, a request to any address outside the machine, a
# page or table wider than it should be, an illegible figure, a build-machine path, or a notebook page
# without its result on the first screen; it keeps screenshots in build/book/screenshots/.
BOOK      := build/book
BOOK_HTML := $(BOOK)/html
# The inputs are read, never made: figures/ and notebooks/executed/ are outputs of the notebook
# rules, so they are not prerequisites (make would run a notebook whose sources are newer than its
# figures). `book` is rebuilt when the list of inputs, a size or a time of change differs from the
# last build's (build/book/inputs.sha1), so a second `make book` does nothing.
BOOK_INPUTS = $(sort $(wildcard book/* book/static/* README.md fisherkron/repro/book/*.py fisherkron/repro/*.py \
                notebooks/*.py notebooks/executed/*.ipynb figures/*.png figures/*.md figures/*.csv figures/*.provenance.json \
                figures/bench/* data/verify/*/*.json))
CHROMIUM  ?= chromium
# Debian packages of the browser test (no recommends: those pull in systemd, CUPS and samba)
CHROMIUM_APT := chromium fonts-liberation

.PHONY: book book-test install-chromium
book: | $(STAMP) ## the executed notebooks as a static HTML site in build/book/html/ (committed files only, offline, under 2 min)
	@mkdir -p $(BOOK); inputs=$$(stat -c '%n %s %Y' $(BOOK_INPUTS) $(STAMP) | sha1sum | cut -d' ' -f1); \
	if [ -f $(BOOK_HTML)/index.html ] && [ "$$(cat $(BOOK)/inputs.sha1 2>/dev/null)" = "$$inputs" ]; then \
	  echo "[book] $(BOOK_HTML)/ is up to date"; exit 0; fi; \
	start=$$SECONDS; rm -rf $(BOOK)/src $(BOOK)/doctrees $(BOOK_HTML).tmp $(BOOK)/inputs.sha1; \
	$(PY) -m fisherkron.repro.book sources $(BOOK)/src; \
	$(PY) -m sphinx -b html -q -W --keep-going -d $(BOOK)/doctrees $(BOOK)/src $(BOOK_HTML).tmp; \
	rm -rf $(BOOK_HTML); mv $(BOOK_HTML).tmp $(BOOK_HTML); echo "$$inputs" > $(BOOK)/inputs.sha1; \
	echo "[book] $(BOOK_HTML)/index.html built in $$((SECONDS - start)) s"

book-test: book | $(STAMP) ## open every page of the book in headless Chromium: console errors, broken links/images, raw mathematics, outside requests
	@command -v $(CHROMIUM) >/dev/null || $(MAKE) --no-print-directory install-chromium
	@start=$$SECONDS; \
	FISHERKRON_BOOK=$(BOOK_HTML) CHROMIUM=$(CHROMIUM) $(PY) -m pytest -q tests/test_book_browser.py; \
	echo "[book-test] every page checked in $$((SECONDS - start)) s; screenshot in $(BOOK)/screenshots/"

install-chromium: ## install Debian's chromium for `make book-test` (apt-get; as root, or through sudo)
	@if [ "$$(id -u)" = 0 ]; then sudo=; elif command -v sudo >/dev/null; then sudo=sudo; \
	 else echo "make book-test needs Chromium: apt-get install $(CHROMIUM_APT) (as root)" >&2; exit 1; fi; \
	$$sudo apt-get update -qq; \
	DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends $(CHROMIUM_APT) >/dev/null; \
	command -v $(CHROMIUM) >/dev/null
