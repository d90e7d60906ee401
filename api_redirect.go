package main

import (
	"net"
	"net/http"
)

// RedirectToHTTPS answers plain HTTP when switchyard serves HTTPS itself
// (server.tls.http_listen): a permanent redirect to HTTPS on httpsPort,
// to a name the certificate is for (the request's Host when serves says
// it is one), and 404 for any other name.
func RedirectToHTTPS(httpsPort string, serves func(host string) bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host, _, err := net.SplitHostPort(r.Host)
		if err != nil {
			host = r.Host
		}
		if !serves(host) {
			writeError(w, r, nil, errorf(CodeNotFound, "this server answers for its certificate's names only"))
			return
		}
		if httpsPort != "443" {
			host = net.JoinHostPort(host, httpsPort)
		}
		http.Redirect(w, r, "https://"+host+r.URL.RequestURI(), http.StatusPermanentRedirect)
	})
}
