// Pasted training data -> [{text, label}] for POST /train's "examples".
// CSV (RFC 4180 quoting, a header naming "text" and "label"; tab-separated
// works too) or JSON lines. The service validates the examples again and
// answers 400 with the problem; this only turns text into rows.

export function parseCsv(src, delimiter) {
  const rows = [];
  let row = [], field = "", i = 0, quoted = false;
  const s = src.replace(/^\uFEFF/, "");
  while (i < s.length) {
    const c = s[i];
    if (quoted) {
      if (c === '"') {
        if (s[i + 1] === '"') { field += '"'; i += 2; continue; }
        quoted = false; i++; continue;
      }
      field += c; i++; continue;
    }
    if (c === '"' && field === "") { quoted = true; i++; continue; }
    if (c === delimiter) { row.push(field); field = ""; i++; continue; }
    if (c === "\r" || c === "\n") {
      row.push(field); field = "";
      if (row.length > 1 || row[0] !== "") rows.push(row);
      row = [];
      i += c === "\r" && s[i + 1] === "\n" ? 2 : 1;
      continue;
    }
    field += c; i++;
  }
  if (quoted) throw new Error("the CSV ends inside a quoted field");
  if (field !== "" || row.length) { row.push(field); rows.push(row); }
  return rows;
}

export function examplesFrom(text) {
  const src = String(text || "").trim();
  if (!src) throw new Error("paste some rows first");
  if (src[0] === "{") {
    return src.split(/\r?\n/).filter((l) => l.trim()).map((line, n) => {
      let o;
      try { o = JSON.parse(line); } catch (e) { throw new Error("line " + (n + 1) + " is not JSON: " + e.message); }
      return {text: o.text, label: o.label};
    });
  }
  const firstLine = src.split(/\r?\n/, 1)[0];
  const delimiter = firstLine.includes("\t") && !firstLine.includes(",") ? "\t" : ",";
  const rows = parseCsv(src, delimiter);
  const header = rows.shift().map((x) => x.trim().toLowerCase());
  const ti = header.indexOf("text"), li = header.indexOf("label");
  if (ti < 0 || li < 0) throw new Error("the first line must be a header naming the columns 'text' and 'label'");
  return rows.map((r) => ({text: r[ti] ?? "", label: r[li] ?? ""}));
}

// Label descriptions -> {label: description} for POST /train's "labels": one
// per line, "label: description" (the label ends at the first colon), or a
// JSON object. Blank lines are skipped; the service checks the rest again.
export function descriptionsFrom(text) {
  const src = String(text || "").trim();
  if (!src) return null;
  if (src[0] === "{") {
    let o;
    try { o = JSON.parse(src); } catch (e) { throw new Error("label descriptions: not JSON (" + e.message + ")"); }
    if (!o || typeof o !== "object" || Array.isArray(o)) throw new Error("label descriptions: a JSON object {label: description}");
    return o;
  }
  const out = {};
  src.split(/\r?\n/).forEach((line, n) => {
    if (!line.trim()) return;
    const at = line.indexOf(":");
    if (at < 0) throw new Error("label descriptions, line " + (n + 1) + ": write it as 'label: description'");
    const label = line.slice(0, at).trim(), description = line.slice(at + 1).trim();
    if (!label) throw new Error("label descriptions, line " + (n + 1) + ": no label before the colon");
    if (Object.hasOwn(out, label)) throw new Error("label descriptions: '" + label + "' is given twice");
    out[label] = description;
  });
  return out;
}
