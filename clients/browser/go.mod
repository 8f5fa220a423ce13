module github.com/idemkit/idem/clients/browser

go 1.22
