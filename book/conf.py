# Sphinx configuration of the book (`make book`, mk/book.mk).
#
# `python -m fisherkron.repro.book sources build/book/src` copies this file into the source
# folder it writes (the pages, the index, MathJax); sphinx-build renders that folder into
# build/book/html. MyST-NB reads the notebooks and never executes one: a page shows the committed
# outputs of notebooks/executed/<name>.ipynb, or the source of a notebook not run yet. Nothing in
# the site is loaded from the network: MathJax 3 comes from the django-static-mathjax package
# (its es5/ folder, copied to _static/mathjax), the theme's fonts and scripts from its own package.
project = "fisherkron"
author = "fisherkron contributors"
copyright = "the fisherkron contributors"

extensions = ["myst_nb", "sphinx.ext.mathjax"]
exclude_patterns = ["_mathjax", "_bookstatic", "_generated", "_build", "**.ipynb_checkpoints"]
root_doc = "index"

# -- notebooks: rendered as committed, never executed --------------------------------------------
nb_execution_mode = "off"
nb_output_stderr = "remove"  # logging and progress bars; they stay in the committed notebook
nb_render_markdown_format = "myst"  # a verdict printed as Markdown may hold $...$ mathematics
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_dmath_double_inline = True  # $$...$$ inside a paragraph, as Jupyter renders it
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]  # the notebooks' headings skip levels (a title, then ###)

# -- mathematics: MathJax 3 from _static/mathjax, no CDN ------------------------------------------
# The SVG output draws every glyph from data inside tex-svg.js: no font file is fetched.
mathjax_path = "mathjax/tex-svg.js"
mathjax3_config = {"options": {"processHtmlClass": "tex2jax_process|mathjax_process|math|output_area"}}

# -- HTML -----------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "fisherkron"
html_static_path = ["_mathjax", "_bookstatic"]  # MathJax; book/static/ (CSS, JS)
html_css_files = ["fisherkron.css"]
html_js_files = ["fisherkron.js"]
html_favicon = "favicon.svg"
html_copy_source = True  # the download button offers each page's notebook, outputs included
html_show_sourcelink = False
html_last_updated_fmt = None
html_context = {"default_mode": "light"}
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "navigation_with_keys": False,
}
