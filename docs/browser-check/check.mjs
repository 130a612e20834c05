// Opens pages of the built docs site in a headless Chromium (@sparticuz/chromium + puppeteer-core) and
// fails when a page logs a console error, throws, or fails to load one of its own files.
// Usage: node check.mjs <built html folder> [page ...]   (default pages: index.html, api/strategies.html)
import { createServer } from "node:http";
import { readFile, stat } from "node:fs/promises";
import { extname, join, normalize, resolve } from "node:path";
import chromium from "@sparticuz/chromium";
import puppeteer from "puppeteer-core";

const site = resolve(process.argv[2] ?? "../_build/html");
const pages = process.argv.length > 3 ? process.argv.slice(3) : ["index.html", "api/strategies.html"];
const types = { ".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml",
  ".png": "image/png", ".json": "application/json", ".woff2": "font/woff2", ".txt": "text/plain" };

// Serve the site over http://127.0.0.1 (a file:// page may not load its scripts the same way).
const server = createServer(async (req, res) => {
  const path = normalize(decodeURIComponent(new URL(req.url, "http://x").pathname));
  let file = join(site, path);
  try {
    if ((await stat(file)).isDirectory()) file = join(file, "index.html");
    const body = await readFile(file);
    res.writeHead(200, { "content-type": types[extname(file)] ?? "application/octet-stream" });
    res.end(body);
  } catch {
    res.writeHead(404);
    res.end("not found");
  }
});
await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
const base = `http://127.0.0.1:${server.address().port}/`;

const browser = await puppeteer.launch({
  args: chromium.args,
  executablePath: await chromium.executablePath(),
  headless: true,
});
let failures = 0;
try {
  for (const page of pages) {
    const tab = await browser.newPage();
    const problems = [];
    tab.on("console", (m) => { if (m.type() === "error") problems.push(`console error: ${m.text()}`); });
    tab.on("pageerror", (e) => problems.push(`uncaught exception: ${e.message}`));
    tab.on("requestfailed", (r) => problems.push(`request failed: ${r.url()} (${r.failure()?.errorText})`));
    tab.on("response", (r) => { if (r.status() >= 400 && r.url().startsWith(base)) problems.push(`HTTP ${r.status()}: ${r.url()}`); });
    const response = await tab.goto(base + page, { waitUntil: "networkidle0", timeout: 30000 });
    if (!response || !response.ok()) problems.push(`HTTP ${response?.status()} for the page itself`);
    const title = await tab.title();
    const headings = await tab.$$eval("h1", (hs) => hs.length);
    if (headings === 0) problems.push("no <h1> rendered");
    console.log(`${problems.length ? "FAIL" : "ok  "} ${page} (title: ${JSON.stringify(title)})`);
    for (const p of problems) console.log(`     ${p}`);
    failures += problems.length ? 1 : 0;
    await tab.close();
  }
} finally {
  await browser.close();
  server.close();
}
console.log(`${pages.length} page(s) rendered in headless Chromium, ${failures} with errors.`);
process.exit(failures ? 1 : 0);
