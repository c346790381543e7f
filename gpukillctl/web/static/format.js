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

export function duration(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return UNKNOWN;
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function celsius(t) {
  return typeof t === "number" ? `${t.toFixed(0)} °C` : UNKNOWN;
}

export function watts(w) {
  return typeof w === "number" ? `${w.toFixed(0)} W` : UNKNOWN;
}

// Joules as J, Wh or kWh, whichever reads best.
export function energy(joules) {
  if (typeof joules !== "number") return UNKNOWN;
  if (joules < 3600) return `${joules.toFixed(0)} J`;
  if (joules < 3.6e6) return `${(joules / 3600).toFixed(1)} Wh`;
  return `${(joules / 3.6e6).toFixed(2)} kWh`;
}

export function clock(epochSeconds) {
  if (typeof epochSeconds !== "number" || epochSeconds <= 0) return UNKNOWN;
  return new Date(epochSeconds * 1000).toLocaleString();
}

export function text(value) {
  return value === null || value === undefined || value === "" ? UNKNOWN : String(value);
}
