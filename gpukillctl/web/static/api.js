// Requests to a host's REST API ("/v1" for this machine, "/hosts/N/v1" for the others), as the page's user:
// the session cookie goes along (same origin only) with the page's half of the session (session.js); every
// body is JSON, with its Content-Type, which the server requires of a session's POST, PUT or DELETE (a
// further lock against a cross-site post).

import {headers} from "./session.js";

// {ok, status, body}; body is the parsed JSON or {error, message} made up for a transport failure. The
// daemon's own message (polkit's refusal, say) is left exactly as it came.
export async function call(api, path, {method = "GET", body} = {}) {
  const init = {method, credentials: "same-origin", headers: {Accept: "application/json", ...headers()}};
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let response;
  try {
    response = await fetch(api + path, init);
  } catch (e) {
    return {ok: false, status: 0, body: {error: "NetworkError", message: `the server did not answer: ${e.message}`}};
  }
  let parsed;
  try {
    parsed = await response.json();
  } catch {
    parsed = {error: "BadReply", message: `HTTP ${response.status} without a JSON body`};
  }
  return {ok: response.ok, status: response.status, body: parsed};
}

// The text to show for a failed call: the server's message as it is, else its error name.
export function failure(result) {
  const body = result.body || {};
  return body.message || body.error || `HTTP ${result.status}`;
}
