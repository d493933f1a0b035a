// Every figure of a page opens at full size when clicked: each image not already inside a link
// is wrapped in one to its own file (the test of the book checks small figures for it).
document.addEventListener("DOMContentLoaded", () => {
  for (const img of document.querySelectorAll(".bd-article img")) {
    if (img.closest("a[href]")) continue;
    const a = document.createElement("a");
    a.href = img.getAttribute("src");
    a.title = "open the figure at full size";
    img.classList.add("figure-link");
    img.replaceWith(a);
    a.appendChild(img);
  }
});
