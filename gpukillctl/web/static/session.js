// The page's half of the dashboard's session. The login's redirect hands it over once, in the URL's fragment
// (/#session=SECRET: a fragment never leaves the browser); it is kept in this origin's localStorage, which no
// page of another port or host can read, and sent as the X-Gpukill-Session header on every request for data.
// The session cookie, which a browser also sends to pages that other local users serve on other ports, counts
// only together with it (gpukillctl/web/session.py).

const KEY = "gpukill-session";
export const HEADER = "X-Gpukill-Session";

// Keep the secret the fragment carries, and take it out of the address bar and the history at once.
export function keep() {
  const match = /^#session=([A-Za-z0-9_-]{1,200})$/.exec(location.hash);
  if (!match) return;
  localStorage.setItem(KEY, match[1]);
  // the address at "/" (the overview), not "#/overview": a later visit to #/PAGE is then a
  // move within this page, not a reload
  history.replaceState(null, "", location.pathname);
}

export function secret() {
  return localStorage.getItem(KEY) || "";
}

// The headers a request for data sends: the secret, where this browser holds one.
export function headers() {
  const value = secret();
  return value ? {[HEADER]: value} : {};
}
