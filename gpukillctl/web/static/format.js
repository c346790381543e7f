// Numbers as people read them. Unknown (null) is shown as "–", never as 0.

const UNKNOWN = "–";

export function bytes(n) {
  if (typeof n !== "number") return UNKNOWN;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n >= 100 || i === 0 ? n.toFixed(0) : n.toFixed(1)} ${units[i]}`;
}

export function percent(p) {
  return typeof p === "number" ? `${p.toFixed(0)} %` : UNKNOWN;
}

// A duration as systemd writes a timespan, as gpukill/units.py format_duration does for the CLI, top and the
// journal: "2h 26min 9s", "3min 30s", "45s", "1.5s", "500ms". At most three units, the largest and the two
// below it, zero parts left out; rounded to the smallest of them (a minute from a day on, a second from ten
// seconds on, a tenth below ten seconds, a millisecond below one); a negative one (a deadline past) is 0s.
const SPAN_UNITS = [["d", 86400], ["h", 3600], ["min", 60], ["s", 1]];

export function duration(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return UNKNOWN;
  const s = Math.max(0, seconds);
  if (s < 0.9995) {
    const ms = Math.round(s * 1000);
    return ms ? `${ms}ms` : "0s";
  }
  if (s < 9.95) return `${Number((Math.round(s * 10) / 10).toFixed(1))}s`;
  const step = s >= 86400 - 0.5 ? 60 : 1;
  let left = Math.round(s / step) * step;
  const parts = [];
  let first = -1;
  SPAN_UNITS.forEach(([unit, size], i) => {
    if (first < 0 && left < size) return;
    if (first < 0) first = i;
    if (i > first + 2) return;
    if (left >= size) {
      parts.push(`${Math.floor(left / size)}${unit}`);
      left %= size;
    }
  });
  return parts.join(" ");
}

export function celsius(t) {
  return typeof t === "number" ? `${t.toFixed(0)} °C` : UNKNOWN;
}

export function watts(w) {
  return typeof w === "number" ? `${w.toFixed(0)} W` : UNKNOWN;
}

// Energy in joules, as the exporter counts it and gpukill/units.py format_energy prints it: "850 J", "212 kJ",
// "1.5 MJ", three significant digits. Unknown (a GPU without a power sensor) is "–", not 0 J.
function three(x) {
  if (x >= 99.95) return x.toFixed(0);
  return x >= 9.995 ? x.toFixed(1) : String(Number(x.toFixed(2)));
}

export function energy(joules) {
  if (typeof joules !== "number" || !Number.isFinite(joules)) return UNKNOWN;
  const j = Math.max(0, joules);
  for (const [unit, size] of [["GJ", 1e9], ["MJ", 1e6], ["kJ", 1e3]]) {
    if (j >= size * 0.9995) return `${three(j / size)} ${unit}`;
  }
  return `${three(j)} J`;
}

// Load levels as nvitop colours them and `gpukillctl top` does (gpukillctl/top/model.py): "light" (green)
// below the first threshold, "moderate" (yellow) from it, "heavy" (red) from the second; "" when unknown.
// Temperature is coloured only from warm on: below its first threshold it has no level.
export const UTIL_LEVELS = [10, 75];
export const MEMORY_LEVELS = [10, 80];
export const TEMPERATURE_LEVELS = [75, 85];

export function load(value, levels, low = "light") {
  if (typeof value !== "number" || !Number.isFinite(value)) return "";
  return value >= levels[1] ? "heavy" : value >= levels[0] ? "moderate" : low;
}

export function clock(epochSeconds) {
  if (typeof epochSeconds !== "number" || epochSeconds <= 0) return UNKNOWN;
  return new Date(epochSeconds * 1000).toLocaleString();
}

export function text(value) {
  return value === null || value === undefined || value === "" ? UNKNOWN : String(value);
}
